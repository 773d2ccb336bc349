# Defaults come from the gpuprov plan (Code Llama 34B, full, 1 x p5e.48xlarge, 8 GPUs, fabric none);
# override any of them in terraform.tfvars.

variable "region" {
  description = "AWS region for every resource"
  type        = string
  default     = "us-east-2"

  validation {
    condition     = can(regex("^[a-z]{2}(-gov)?-[a-z]+-[0-9]$", var.region))
    error_message = "region must look like us-east-1."
  }
}

variable "name_prefix" {
  description = "Prefix for every resource name"
  type        = string
  default     = "gpuprov-34b"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,23}$", var.name_prefix))
    error_message = "name_prefix: 2-24 lowercase letters, digits or dashes, starting with a letter."
  }
}

variable "instance_type" {
  description = "EC2 instance type of every node"
  type        = string
  default     = "p5e.48xlarge"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]*\\.[0-9a-z]+$", var.instance_type))
    error_message = "instance_type must be an EC2 instance type such as p5.48xlarge."
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

variable "efa_enabled" {
  description = "Attach EFA interfaces (false: a single ENA interface, for instances without EFA)"
  type        = bool
  default     = false
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
  description = "Private subnet for the nodes (with a NAT route for package downloads)"
  type        = string

  validation {
    condition     = can(regex("^subnet-[0-9a-f]+$", var.subnet_id))
    error_message = "subnet_id must be a subnet id such as subnet-0123456789abcdef0."
  }
}

variable "availability_zone" {
  description = "Availability zone of the capacity reservation; the subnet must be in it"
  type        = string
  default     = null
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

variable "capacity_block" {
  description = "The reservation is a Capacity Block for ML (market type capacity-block)"
  type        = bool
  default     = false
}

variable "ami_id" {
  description = "AMI for the nodes (null: the latest Ubuntu LTS from ami_ssm_parameter)"
  type        = string
  default     = null

  validation {
    condition     = var.ami_id == null || can(regex("^ami-[0-9a-f]+$", var.ami_id))
    error_message = "ami_id must look like ami-0123456789abcdef0."
  }
}

variable "ami_ssm_parameter" {
  description = "Public SSM parameter naming the default AMI"
  type        = string
  default     = "/aws/service/canonical/ubuntu/server/22.04/stable/current/amd64/hvm/ebs-gp3/ami-id"
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
  description = "EC2 key pair for SSH (null: no key; use SSM Session Manager)"
  type        = string
  default     = null
}

variable "ssh_cidr" {
  description = "CIDR allowed to SSH to the nodes (null: no SSH rule; use SSM)"
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
    "managed-by"    = "gpuprov"
    "gpuprov-model" = "34b"
  }
}
