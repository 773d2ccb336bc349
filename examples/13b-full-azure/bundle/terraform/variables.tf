# Defaults come from the gpuprov plan (Llama 2 13B, full, 32 x Standard_ND96isr_H200_v5, 256 GPUs, fabric infiniband, on-demand);
# override any of them in terraform.tfvars.

variable "location" {
  description = "Azure region for every resource"
  type        = string
  default     = "eastus"

  validation {
    condition     = can(regex("^[a-z]+[a-z0-9]*$", var.location))
    error_message = "location must be an Azure region name such as eastus."
  }
}

variable "resource_group_name" {
  description = "Resource group to create for the cluster"
  type        = string
  default     = "gpuprov-13b-6f0402-rg"

  validation {
    condition     = can(regex("^[-\\w.()]{1,89}[-\\w()]$", var.resource_group_name))
    error_message = "resource_group_name: up to 90 letters, digits, dashes, underscores, dots or parentheses."
  }
}

variable "name_prefix" {
  description = "Prefix for every resource name"
  type        = string
  default     = "gpuprov-13b-6f0402"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,23}$", var.name_prefix))
    error_message = "name_prefix: 2-24 lowercase letters, digits or dashes, starting with a letter."
  }
}

variable "vm_size" {
  description = "VM size of every node (an InfiniBand ND size)"
  type        = string
  default     = "Standard_ND96isr_H200_v5"

  validation {
    condition     = can(regex("^Standard_[A-Za-z0-9_]+$", var.vm_size))
    error_message = "vm_size must be an Azure VM size such as Standard_ND96isr_H100_v5."
  }
}

variable "node_count" {
  description = "Number of GPU nodes (8 GPUs each); one InfiniBand scale set holds at most 100"
  type        = number
  default     = 32

  validation {
    condition     = var.node_count >= 1 && var.node_count <= 100 && floor(var.node_count) == var.node_count
    error_message = "node_count must be a whole number from 1 to 100: single_placement_group caps a scale set at 100 VMs."
  }
}

variable "admin_username" {
  description = "Admin user on every VM (SSH key only; Ansible's ansible_user)"
  type        = string
  default     = "azureuser"

  validation {
    condition     = can(regex("^[a-z_][a-z0-9_-]{0,31}$", var.admin_username))
    error_message = "admin_username must be a Linux user name."
  }
}

variable "ssh_public_key" {
  description = "OpenSSH public key for admin_username (a public key, not a secret)"
  type        = string

  validation {
    condition     = can(regex("^(ssh-(rsa|ed25519)|ecdsa-sha2-nistp[0-9]+) ", var.ssh_public_key))
    error_message = "ssh_public_key must be an OpenSSH public key line (ssh-rsa ..., ssh-ed25519 ...)."
  }
}

variable "image" {
  description = "Marketplace image: the Ubuntu HPC image carries the InfiniBand drivers, NCCL and topology files"
  type = object({
    publisher = string
    offer     = string
    sku       = string
    version   = string
  })
  default = {
    "publisher" = "microsoft-dsvm"
    "offer"     = "ubuntu-hpc"
    "sku"       = "2204"
    "version"   = "latest"
  }
}

variable "os_disk_size_gb" {
  description = "OS disk size in GB (data goes to the local NVMe RAID)"
  type        = number
  default     = 512

  validation {
    condition     = var.os_disk_size_gb >= 64 && var.os_disk_size_gb <= 4095
    error_message = "os_disk_size_gb must be between 64 and 4095."
  }
}

variable "encryption_at_host" {
  description = "Encrypt temp and cache disks at the host (register the EncryptionAtHost feature on the subscription first: az feature register --namespace Microsoft.Compute --name EncryptionAtHost)"
  type        = bool
  default     = false
}

variable "purchase_option" {
  description = "How the VMs are bought: on-demand (Regular priority) or spot"
  type        = string
  default     = "on-demand"

  validation {
    condition     = contains(["on-demand", "spot"], var.purchase_option)
    error_message = "purchase_option must be on-demand or spot."
  }
}

variable "bastion_host" {
  description = "Jump host (user@host) Ansible reaches the private nodes through (null: run from inside the VNet)"
  type        = string
  default     = null
}

variable "vnet_cidr" {
  description = "Address space of the VNet (the node subnet is its second /+8 block)"
  type        = string
  default     = "10.40.0.0/16"

  validation {
    condition     = can(cidrsubnet(var.vnet_cidr, 8, 1))
    error_message = "vnet_cidr must be a CIDR block of /24 or wider."
  }
}

variable "ssh_cidr" {
  description = "CIDR allowed to SSH to the nodes (null: no inbound SSH rule)"
  type        = string
  default     = null

  validation {
    condition     = var.ssh_cidr == null || can(cidrhost(var.ssh_cidr, 0))
    error_message = "ssh_cidr must be a CIDR block such as 203.0.113.0/24."
  }
}

variable "tags" {
  description = "Tags on every resource"
  type        = map(string)
  default = {
    "managed-by"     = "gpuprov"
    "gpuprov-model"  = "13b"
    "gpuprov-bundle" = "6f0402"
  }
}

variable "shared_storage_tib" {
  description = "Azure Managed Lustre capacity in TiB for checkpoints and data (0: no shared filesystem)"
  type        = number
  default     = 4

  validation {
    condition     = var.shared_storage_tib == 0 || (var.shared_storage_tib >= 4 && var.shared_storage_tib % 4 == 0)
    error_message = "shared_storage_tib must be 0 or a multiple of 4 (AMLFS-Durable-Premium-500 steps)."
  }
}

variable "shared_storage_sku" {
  description = "Azure Managed Lustre SKU (throughput per TiB)"
  type        = string
  default     = "AMLFS-Durable-Premium-500"
}

variable "shared_storage_zone" {
  description = "Availability zone of the Managed Lustre file system"
  type        = string
  default     = "1"
}

variable "shared_mount_point" {
  description = "Where every node mounts the shared filesystem (checkpoints under <mount>/checkpoints)"
  type        = string
  default     = "/shared"
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
