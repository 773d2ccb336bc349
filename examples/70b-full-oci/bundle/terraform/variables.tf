# Defaults come from the gpuprov plan (Llama 3.1 70B, full, 6 x BM.GPU.A100-v2.8, 48 GPUs, fabric roce);
# override any of them in terraform.tfvars.

variable "region" {
  description = "OCI region for every resource"
  type        = string
  default     = "us-ashburn-1"

  validation {
    condition     = can(regex("^[a-z]+-[a-z]+-[0-9]+$", var.region))
    error_message = "region must look like us-ashburn-1."
  }
}

variable "compartment_ocid" {
  description = "Compartment that holds the cluster"
  type        = string

  validation {
    condition     = can(regex("^ocid1\\.(compartment|tenancy)\\.", var.compartment_ocid))
    error_message = "compartment_ocid must be a compartment (or tenancy) OCID."
  }
}

variable "availability_domain" {
  description = "Availability domain with capacity for the GPU shape, such as Uocm:US-ASHBURN-AD-1"
  type        = string

  validation {
    condition     = can(regex("^[A-Za-z0-9]+:[A-Z0-9-]+-AD-[0-9]$", var.availability_domain))
    error_message = "availability_domain must look like Uocm:US-ASHBURN-AD-1."
  }
}

variable "subnet_id" {
  description = "Private subnet for the nodes' primary VNIC (with a NAT gateway route)"
  type        = string

  validation {
    condition     = can(regex("^ocid1\\.subnet\\.", var.subnet_id))
    error_message = "subnet_id must be a subnet OCID."
  }
}

variable "image_id" {
  description = "Image OCID for the GPU shape (an Oracle Linux or Ubuntu GPU image of this region)"
  type        = string

  validation {
    condition     = can(regex("^ocid1\\.image\\.", var.image_id))
    error_message = "image_id must be an image OCID."
  }
}

variable "name_prefix" {
  description = "Prefix for every resource name"
  type        = string
  default     = "gpuprov-70b"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,23}$", var.name_prefix))
    error_message = "name_prefix: 2-24 lowercase letters, digits or dashes, starting with a letter."
  }
}

variable "shape" {
  description = "Bare-metal GPU shape of every node (must support cluster networks)"
  type        = string
  default     = "BM.GPU.A100-v2.8"

  validation {
    condition     = can(regex("^BM\\.GPU", var.shape))
    error_message = "shape must be a bare-metal GPU shape such as BM.GPU.H100.8."
  }
}

variable "node_count" {
  description = "Number of GPU nodes (8 GPUs each)"
  type        = number
  default     = 6

  validation {
    condition     = var.node_count >= 1 && floor(var.node_count) == var.node_count
    error_message = "node_count must be a whole number >= 1."
  }
}

variable "boot_volume_size_gb" {
  description = "Boot volume size in GB (data goes to the local NVMe RAID)"
  type        = number
  default     = 512

  validation {
    condition     = var.boot_volume_size_gb >= 50 && var.boot_volume_size_gb <= 32768
    error_message = "boot_volume_size_gb must be between 50 and 32768."
  }
}

variable "ssh_public_key" {
  description = "OpenSSH public key(s) for the default user (public keys, not secrets)"
  type        = string

  validation {
    condition     = can(regex("^(ssh-(rsa|ed25519)|ecdsa-sha2-nistp[0-9]+) ", var.ssh_public_key))
    error_message = "ssh_public_key must be an OpenSSH public key line (ssh-rsa ..., ssh-ed25519 ...)."
  }
}

variable "freeform_tags" {
  description = "Free-form tags on every resource"
  type        = map(string)
  default = {
    "managed-by"    = "gpuprov"
    "gpuprov-model" = "70b"
  }
}
