terraform {
  # Remote state, so that two people (or CI) cannot apply at once: set terraform_backend (type and
  # config, as below) in the gpuprov spec and regenerate; it is rendered into backend.tf (editing
  # this file is drift). Then `terraform init -migrate-state`.
  # S3 locks with a lock file beside the state (use_lockfile,
  # Terraform >= 1.10); local state has no lock and is lost with this folder.
  # backend "s3" {
  #   bucket       = "my-terraform-state"
  #   key          = "gpuprov/NAME/terraform.tfstate"
  #   region       = "us-east-1"
  #   encrypt      = true
  #   use_lockfile = true
  # }

  required_version = ">= 1.5.0"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 6.0, < 7.0"
    }
  }
}
