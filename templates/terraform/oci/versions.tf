terraform {
  # Remote state, so that two people (or CI) cannot apply at once: set terraform_backend (type and
  # config, as below) in the gpuprov spec and regenerate; it is rendered into backend.tf (editing
  # this file is drift). Then `terraform init -migrate-state`.
  # The oci backend (Terraform >= 1.12) keeps the state in
  # Object Storage with locking; local state has no lock and is lost with this folder.
  # backend "oci" {
  #   bucket    = "terraform-state"
  #   namespace = "my-namespace"
  #   key       = "gpuprov/NAME/terraform.tfstate"
  # }

  required_version = ">= 1.5.0"

  required_providers {
    oci = {
      source  = "oracle/oci"
      version = ">= 6.0, < 8.0"
    }
  }
}
