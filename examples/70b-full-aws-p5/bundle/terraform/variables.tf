# Defaults come from the gpuprov plan (Llama 3.1 70B, full, 16 x p5.48xlarge, 128 GPUs, fabric efa, on-demand);
# override any of them in terraform.tfvars.

variable "region" {
  description = "AWS region for every resource"
  type        = string
  default     = "us-east-1"

  validation {
    condition     = can(regex("^[a-z]{2}(-gov)?-[a-z]+-[0-9]$", var.region))
    error_message = "region must look like us-east-1."
  }
}

variable "name_prefix" {
  description = "Prefix for every resource name"
  type        = string
  default     = "gpuprov-70b-28f648"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,23}$", var.name_prefix))
    error_message = "name_prefix: 2-24 lowercase letters, digits or dashes, starting with a letter."
  }
}

variable "instance_type" {
  description = "EC2 instance type of every node"
  type        = string
  default     = "p5.48xlarge"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]*\\.[0-9a-z]+$", var.instance_type))
    error_message = "instance_type must be an EC2 instance type such as p5.48xlarge."
  }
}

variable "node_count" {
  description = "Number of GPU nodes (8 GPUs each)"
  type        = number
  default     = 16

  validation {
    condition     = var.node_count >= 1 && floor(var.node_count) == var.node_count
    error_message = "node_count must be a whole number >= 1."
  }
}

variable "efa_enabled" {
  description = "Attach EFA interfaces (false: a single ENA interface, for instances without EFA)"
  type        = bool
  default     = true
}

variable "network_cards" {
  description = "Network cards of the instance type; with EFA each card gets one EFA interface"
  type        = number
  default     = 32

  validation {
    condition     = var.network_cards >= 1 && var.network_cards <= 64 && floor(var.network_cards) == var.network_cards
    error_message = "network_cards must be a whole number between 1 and 64."
  }
}

variable "subnet_id" {
  description = "Your private subnet for the nodes, with a NAT route or SSM endpoints (null: the bundle creates a VPC with one; gpuprov validate checks a given subnet's routes)"
  type        = string
  default     = null

  validation {
    condition     = var.subnet_id == null || can(regex("^subnet-[0-9a-f]+$", var.subnet_id))
    error_message = "subnet_id must be a subnet id such as subnet-0123456789abcdef0."
  }
}

variable "vpc_cidr" {
  description = "Address space of the VPC the bundle creates (public NAT subnet: first /24; node subnet: second /20)"
  type        = string
  default     = "10.60.0.0/16"

  validation {
    condition     = can(cidrhost(var.vpc_cidr, 0))
    error_message = "vpc_cidr must be a CIDR block such as 10.60.0.0/16."
  }
}

variable "availability_zone" {
  description = "Zone of the nodes; required with a capacity reservation (its zone). null: subnet_id's zone, or the region's first zone offering instance_type"
  type        = string
  default     = null

  validation {
    condition     = var.availability_zone == null || can(regex("^[a-z]{2}(-gov)?-[a-z]+-[0-9][a-z]$", var.availability_zone))
    error_message = "availability_zone must look like us-east-1a."
  }
}

variable "capacity_reservation_id" {
  description = "On-Demand Capacity Reservation or Capacity Block id to launch into (null: none)"
  type        = string
  default     = null

  validation {
    condition     = var.capacity_reservation_id == null || can(regex("^cr-[0-9a-f]+$", var.capacity_reservation_id))
    error_message = "capacity_reservation_id must look like cr-0123456789abcdef0."
  }
}

variable "purchase_option" {
  description = "How the nodes are bought: on-demand, spot, capacity-block (Capacity Block for ML) or reservation (ODCR)"
  type        = string
  default     = "on-demand"

  validation {
    condition     = contains(["on-demand", "spot", "capacity-block", "reservation"], var.purchase_option)
    error_message = "purchase_option must be on-demand, spot, capacity-block or reservation."
  }
}

variable "replaced_nodes" {
  description = "Nodes whose fleet instance was lost (a reclaimed spot node, a failed host), each replaced by an instance under the same name, and the node count and purchase option of the fleet they were lost from (gpuprov up writes it to replaced_nodes.auto.tfvars.json; null: none)"
  type = object({
    names           = set(string)
    node_count      = number
    purchase_option = string
  })
  default = null
}

variable "placement_group_name" {
  description = "Existing placement group to launch into (null: a new cluster group for on-demand and spot nodes, none in a reservation or Capacity Block)"
  type        = string
  default     = null
}

variable "ami_id" {
  description = "AMI for the nodes (null: read ami_ssm_parameter once; running nodes keep their image)"
  type        = string
  default     = null

  validation {
    condition     = var.ami_id == null || can(regex("^ami-[0-9a-f]+$", var.ami_id))
    error_message = "ami_id must look like ami-0123456789abcdef0."
  }
}

variable "ami_ssm_parameter" {
  description = "Public SSM parameter naming the default AMI (Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04))"
  type        = string
  default     = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
}

variable "root_volume_size_gib" {
  description = "Root EBS volume size in GiB (OS, drivers, containers; data goes to the local NVMe RAID)"
  type        = number
  default     = 512

  validation {
    condition     = var.root_volume_size_gib >= 64
    error_message = "root_volume_size_gib must be at least 64."
  }
}

variable "kms_key_arn" {
  description = "KMS key for the EBS volumes (null: the account's default EBS key)"
  type        = string
  default     = null
}

variable "key_name" {
  description = "EC2 key pair whose private key Ansible uses; SSH runs through SSM Session Manager, no port is opened"
  type        = string
}

variable "ssh_user" {
  description = "Login user of the image (Ansible's ansible_user)"
  type        = string
  default     = "ubuntu"
}

variable "ssh_proxy_command" {
  description = "ProxyCommand that carries SSH to a node by instance id (%h) through SSM; --region is appended"
  type        = string
  default     = "aws ssm start-session --target %h --document-name AWS-StartSSHSession --parameters portNumber=%p"
}

variable "shared_storage_gib" {
  description = "FSx for Lustre capacity in GiB for checkpoints and data (0: no shared filesystem)"
  type        = number
  default     = 4800

  validation {
    condition     = var.shared_storage_gib == 0 || var.shared_storage_gib == 1200 || (var.shared_storage_gib >= 2400 && var.shared_storage_gib % 2400 == 0)
    error_message = "shared_storage_gib must be 0, 1200 or a multiple of 2400 (FSx for Lustre SSD sizes)."
  }
}

variable "shared_storage_deployment_type" {
  description = "FSx for Lustre deployment type"
  type        = string
  default     = "PERSISTENT_2"
}

variable "shared_storage_throughput_per_tib" {
  description = "FSx for Lustre throughput per TiB of storage, MB/s"
  type        = number
  default     = 125
}

variable "shared_mount_point" {
  description = "Where every node mounts the shared filesystem (checkpoints under <mount>/checkpoints)"
  type        = string
  default     = "/shared"
}

variable "tags" {
  description = "Tags on every resource"
  type        = map(string)
  default = {
    "managed-by"     = "gpuprov"
    "gpuprov-model"  = "70b"
    "gpuprov-bundle" = "28f648"
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
