terraform {
  # Remote state, so that two people (or CI) cannot apply at once: set terraform_backend (type and
  # config, as below) in the gpuprov spec and regenerate; it is rendered into backend.tf (editing
  # this file is drift). Then `terraform init -migrate-state`.
  # The azurerm backend locks with a blob lease; local state
  # has no lock and is lost with this folder.
  # backend "azurerm" {
  #   resource_group_name  = "tfstate"
  #   storage_account_name = "mytfstate"
  #   container_name       = "tfstate"
  #   key                  = "gpuprov/NAME.tfstate"
  # }

  required_version = ">= 1.5.0"

  required_providers {
    azurerm = {
      source  = "hashicorp/azurerm"
      version = ">= 4.0, < 5.0"
    }
  }
}
