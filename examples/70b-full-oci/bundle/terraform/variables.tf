# Defaults come from the gpuprov plan (Llama 3.1 70B, full, 7 x BM.GPU.H100.8, 56 GPUs, fabric roce, on-demand);
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
  description = "Image OCID for the GPU shape: a Canonical Ubuntu 22.04/24.04 GPU image of the region (the roles run on Ubuntu only), image_id in terraform.tfvars (the Ansible roles run on Ubuntu only)"
  type        = string

  validation {
    condition     = can(regex("^ocid1\\.image\\.", var.image_id))
    error_message = "image_id must be an image OCID."
  }
}

variable "name_prefix" {
  description = "Prefix for every resource name"
  type        = string
  default     = "gpuprov-70b-bd4a0e"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,23}$", var.name_prefix))
    error_message = "name_prefix: 2-24 lowercase letters, digits or dashes, starting with a letter."
  }
}

variable "shape" {
  description = "Bare-metal GPU shape of every node (must support cluster networks)"
  type        = string
  default     = "BM.GPU.H100.8"

  validation {
    condition     = can(regex("^BM\\.GPU", var.shape))
    error_message = "shape must be a bare-metal GPU shape such as BM.GPU.H100.8."
  }
}

variable "node_count" {
  description = "Number of GPU nodes (8 GPUs each)"
  type        = number
  default     = 7

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

variable "ssh_user" {
  description = "Login user of the image (ubuntu on the Canonical Ubuntu images the roles support)"
  type        = string
  default     = "ubuntu"
}

variable "ssh_cidr" {
  description = "CIDR allowed to SSH to public node addresses (null: nodes stay private; the subnet must be public otherwise)"
  type        = string
  default     = null

  validation {
    condition     = var.ssh_cidr == null || can(cidrhost(var.ssh_cidr, 0))
    error_message = "ssh_cidr must be a CIDR block such as 203.0.113.0/24."
  }
}

variable "bastion_host" {
  description = "Jump host (user@host) Ansible reaches the private nodes through (null: run from inside the VCN)"
  type        = string
  default     = null
}

variable "shared_storage" {
  description = "Create an OCI File Storage file system for checkpoints and data, mounted on every node"
  type        = bool
  default     = true
}

variable "kms_key_id" {
  description = "Vault key for the shared file system (null: Oracle-managed encryption)"
  type        = string
  default     = null
}

variable "shared_mount_point" {
  description = "Where every node mounts the shared filesystem (checkpoints under <mount>/checkpoints)"
  type        = string
  default     = "/shared"
}

variable "freeform_tags" {
  description = "Free-form tags on every resource"
  type        = map(string)
  default = {
    "managed-by"     = "gpuprov"
    "gpuprov-model"  = "70b"
    "gpuprov-bundle" = "bd4a0e"
  }
}

variable "owner" {
  description = "Who owns the cluster (tag/label owner on every resource; null: none)"
  type        = string
  default     = null
}

variable "expires_on" {
  description = "Date after which the cluster may be deleted, YYYY-MM-DD (tag/label expires-on; null: none)"
  type        = string
  default     = null

  validation {
    condition     = var.expires_on == null || can(regex("^[0-9]{4}-[0-9]{2}-[0-9]{2}$", var.expires_on))
    error_message = "expires_on must be a date such as 2026-12-31."
  }
}
