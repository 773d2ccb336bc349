terraform {
  # Remote state, so that two people (or CI) cannot apply at once: uncomment, fill in, then
  # `terraform init -migrate-state`. The azurerm backend locks with a blob lease; local state
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
