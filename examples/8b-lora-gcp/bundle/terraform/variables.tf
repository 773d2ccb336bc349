# Defaults come from the gpuprov plan (Llama 3.1 8B, lora, 1 x a3-ultragpu-8g, 8 GPUs, fabric none, flex-start);
# override any of them in terraform.tfvars.

variable "project_id" {
  description = "Google Cloud project that holds every resource"
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.project_id))
    error_message = "project_id must be a project id (6-30 lowercase letters, digits or dashes)."
  }
}

variable "region" {
  description = "Region of the networks and the placement policy"
  type        = string
  default     = "us-central1"

  validation {
    condition     = can(regex("^[a-z]+-[a-z]+[0-9]$", var.region))
    error_message = "region must look like us-central1."
  }
}

variable "zone" {
  description = "Zone of the VMs: one that offers the machine type (and holds the reservation, if any)"
  type        = string

  validation {
    condition     = can(regex("^[a-z]+-[a-z]+[0-9]-[a-z]$", var.zone))
    error_message = "zone must look like us-central1-a."
  }
}

variable "name_prefix" {
  description = "Prefix for every resource name"
  type        = string
  default     = "gpuprov-8b-a97479"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,23}$", var.name_prefix))
    error_message = "name_prefix: 2-24 lowercase letters, digits or dashes, starting with a letter."
  }
}

variable "machine_type" {
  description = "Machine type of every node (GPUs are part of the a2/a3/a4 machine types)"
  type        = string
  default     = "a3-ultragpu-8g"

  validation {
    condition     = can(regex("^[a-z][a-z0-9]*-[a-z0-9-]+$", var.machine_type))
    error_message = "machine_type must be a machine type such as a3-megagpu-8g."
  }
}

variable "node_count" {
  description = "Number of GPU nodes (8 GPUs each)"
  type        = number
  default     = 1

  validation {
    condition     = var.node_count >= 1 && floor(var.node_count) == var.node_count
    error_message = "node_count must be a whole number >= 1."
  }
}

variable "gpu_nic_count" {
  description = "gVNIC data networks beside nic0 (8 for a3-megagpu TCPXO, 4 for a3-highgpu TCPX, 1 on RoCE machines)"
  type        = number
  default     = 0

  validation {
    condition     = contains([0, 1, 2, 4, 8], var.gpu_nic_count)
    error_message = "gpu_nic_count must be 0, 1, 2, 4 or 8."
  }
}

variable "rdma_nic_count" {
  description = "MRDMA NICs, one subnet each in the RoCE VPC (8 for a3-ultragpu-8g and a4-highgpu-8g, else 0)"
  type        = number
  default     = 0

  validation {
    condition     = contains([0, 8], var.rdma_nic_count)
    error_message = "rdma_nic_count must be 0 or 8."
  }
}

variable "gpu_network_mtu" {
  description = "MTU of the VPCs (8896 for GPUDirect-TCPXO and RoCE)"
  type        = number
  default     = 8896

  validation {
    condition     = var.gpu_network_mtu >= 1300 && var.gpu_network_mtu <= 8896
    error_message = "gpu_network_mtu must be between 1300 and 8896."
  }
}

variable "primary_cidr" {
  description = "IPv4 range of the primary (nic0) subnet"
  type        = string
  default     = "10.0.0.0/16"

  validation {
    condition     = can(cidrhost(var.primary_cidr, 0))
    error_message = "primary_cidr must be a CIDR block."
  }
}

variable "gpu_cidr" {
  description = "IPv4 range split into one /(prefix+8) subnet per gVNIC data network"
  type        = string
  default     = "10.128.0.0/12"

  validation {
    condition     = can(cidrsubnet(var.gpu_cidr, 8, 0))
    error_message = "gpu_cidr must be a CIDR block of /24 or wider."
  }
}

variable "rdma_cidr" {
  description = "IPv4 range split into one /(prefix+8) subnet per MRDMA NIC"
  type        = string
  default     = "10.192.0.0/12"

  validation {
    condition     = can(cidrsubnet(var.rdma_cidr, 8, 0))
    error_message = "rdma_cidr must be a CIDR block of /24 or wider."
  }
}

variable "purchase_option" {
  description = "How the VMs are bought: on-demand (STANDARD), spot, flex-start (DWS) or reservation"
  type        = string
  default     = "flex-start"

  validation {
    condition     = contains(["on-demand", "spot", "flex-start", "reservation"], var.purchase_option)
    error_message = "purchase_option must be on-demand, spot, flex-start or reservation."
  }
}

variable "reservation_bound" {
  description = "The machine type consumes reservations RESERVATION_BOUND (a3-ultragpu, a4)"
  type        = bool
  default     = false
}

variable "max_run_hours" {
  description = "flex-start: hours a VM runs before it is deleted (at most 168)"
  type        = number
  default     = 168

  validation {
    condition     = var.max_run_hours >= 1 && var.max_run_hours <= 168
    error_message = "max_run_hours must be between 1 and 168 (flex-start runs at most 7 days)."
  }
}

variable "compact_placement_supported" {
  description = "The machine family accepts a compact placement policy (used when node_count > 1 and no reservation is set)"
  type        = bool
  default     = true
}

variable "reservation_name" {
  description = "Consume this specific reservation: a name, or projects/P/reservations/R for a shared one"
  type        = string
  default     = null

  validation {
    condition     = var.reservation_name == null || can(regex("^(projects/[a-z][-a-z0-9]{4,28}[a-z0-9]/reservations/)?[a-z]([-a-z0-9]*[a-z0-9])?(/reservationBlocks/[-a-z0-9]+(/reservationSubBlocks/[-a-z0-9]+)?)?$", var.reservation_name))
    error_message = "reservation_name must be a reservation name such as my-a3-reservation, or projects/P/reservations/R."
  }
}

variable "image_project" {
  description = "Project of the boot image family"
  type        = string
  default     = "ubuntu-os-accelerator-images"
}

variable "image_family" {
  description = "Boot image family (Ubuntu 22.04 accelerator image with the NVIDIA 570 driver): its image at the first apply is pinned"
  type        = string
  default     = "ubuntu-accelerator-2204-amd64-with-nvidia-570"
}

variable "image" {
  description = "An explicit boot image (self link or projects/P/global/images/NAME) instead of the pinned family image"
  type        = string
  default     = null
}

variable "boot_disk_type" {
  description = "Boot disk type (a3/a4 machines take Hyperdisk, a2 Persistent Disk)"
  type        = string
  default     = "hyperdisk-balanced"

  validation {
    condition     = contains(["pd-balanced", "pd-ssd", "hyperdisk-balanced"], var.boot_disk_type)
    error_message = "boot_disk_type must be pd-balanced, pd-ssd or hyperdisk-balanced."
  }
}

variable "boot_disk_size_gb" {
  description = "Boot disk size in GB (OS, drivers, containers; data goes to the local SSD RAID)"
  type        = number
  default     = 500

  validation {
    condition     = var.boot_disk_size_gb >= 64
    error_message = "boot_disk_size_gb must be at least 64."
  }
}

variable "kms_key_self_link" {
  description = "Cloud KMS key for the boot disks (null: Google-managed encryption)"
  type        = string
  default     = null

  validation {
    condition     = var.kms_key_self_link == null || can(regex("^projects/[^/]+/locations/[^/]+/keyRings/[^/]+/cryptoKeys/[^/]+$", var.kms_key_self_link))
    error_message = "kms_key_self_link must look like projects/P/locations/L/keyRings/R/cryptoKeys/K."
  }
}

variable "secure_boot" {
  description = "Shielded VM secure boot: off because the driver role may build DKMS modules no enrolled key signs"
  type        = bool
  default     = false
}

variable "service_account_email" {
  description = "Service account for the VMs (null: none attached)"
  type        = string
  default     = null
}

variable "ssh_user" {
  description = "Your OS Login POSIX user name (gcloud compute os-login describe-profile --format='value(posixAccounts[0].username)')"
  type        = string
}

variable "ssh_proxy_command" {
  description = "ProxyCommand that tunnels SSH to a VM by name (%h) through IAP; --project and --zone are appended"
  type        = string
  default     = "gcloud compute start-iap-tunnel %h %p --listen-on-stdin --verbosity=warning"
}

variable "iap_cidr" {
  description = "Source range of IAP TCP forwarding (Google's published range)"
  type        = string
  default     = "35.235.240.0/20"
}

variable "shared_storage_gib" {
  description = "Filestore capacity in GiB for checkpoints and data (0: no shared filesystem)"
  type        = number
  default     = 0

  validation {
    condition     = var.shared_storage_gib == 0 || var.shared_storage_gib >= 1024
    error_message = "shared_storage_gib must be 0 or at least 1024 (Filestore zonal minimum)."
  }
}

variable "shared_storage_tier" {
  description = "Filestore service tier"
  type        = string
  default     = "ZONAL"
}

variable "shared_mount_point" {
  description = "Where every node mounts the shared filesystem (checkpoints under <mount>/checkpoints)"
  type        = string
  default     = "/shared"
}

variable "ssh_cidr" {
  description = "CIDR also allowed to SSH to the nodes (IAP TCP forwarding is always allowed)"
  type        = string
  default     = null

  validation {
    condition     = var.ssh_cidr == null || can(cidrhost(var.ssh_cidr, 0))
    error_message = "ssh_cidr must be a CIDR block such as 203.0.113.0/24."
  }
}

variable "labels" {
  description = "Labels on every resource"
  type        = map(string)
  default = {
    "managed-by"     = "gpuprov"
    "gpuprov-model"  = "8b"
    "gpuprov-bundle" = "a97479"
  }
}

variable "owner" {
  description = "Who owns the cluster (tag/label owner on every resource; null: none)"
  type        = string
  default     = null

  validation {
    condition     = var.owner == null || can(regex("^[a-z0-9_-]{1,63}$", var.owner))
    error_message = "owner becomes a label: up to 63 lowercase letters, digits, dashes or underscores."
  }
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
