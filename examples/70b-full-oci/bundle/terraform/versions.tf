terraform {
  # Remote state, so that two people (or CI) cannot apply at once: uncomment, fill in, then
  # `terraform init -migrate-state`. The oci backend (Terraform >= 1.12) keeps the state in
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
