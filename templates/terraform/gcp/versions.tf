terraform {
  # Remote state, so that two people (or CI) cannot apply at once: set terraform_backend (type and
  # config, as below) in the gpuprov spec and regenerate; it is rendered into backend.tf (editing
  # this file is drift). Then `terraform init -migrate-state`.
  # The gcs backend locks the state itself; local state has no
  # lock and is lost with this folder.
  # backend "gcs" {
  #   bucket = "my-terraform-state"
  #   prefix = "gpuprov/NAME"
  # }

  required_version = ">= 1.5.0"

  required_providers {
    google = {
      source  = "hashicorp/google"
      version = ">= 6.20, < 7.0"
    }
  }
}
