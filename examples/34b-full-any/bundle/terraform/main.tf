# GPU nodes for the gpuprov plan: one EC2 instance per node, all from one launch template that
# carries the EFA interfaces, the cluster placement group and the (optional) capacity reservation.

provider "aws" {
  region = var.region

  default_tags {
    tags = var.tags
  }
}

################################################################################
# Lookups
################################################################################

data "aws_partition" "current" {}

data "aws_subnet" "nodes" {
  id = var.subnet_id
}

# Canonical's public SSM parameter for the current Ubuntu LTS image; the Ansible roles install the
# NVIDIA driver, EFA and NCCL at the versions the plan pins.
data "aws_ssm_parameter" "ubuntu" {
  name = var.ami_ssm_parameter
}

locals {
  ami_id = coalesce(var.ami_id, data.aws_ssm_parameter.ubuntu.insecure_value)

  # AWS's layout for multi-card EFA instances: network card 0 carries the ENA primary interface
  # (device 0) plus an EFA-only interface (device 1); every other card carries one EFA-only
  # interface (device 0). Without EFA the node gets a single ENA interface.
  network_interfaces = var.efa_enabled ? concat(
    [
      { card = 0, device = 0, type = "interface" },
      { card = 0, device = 1, type = "efa-only" },
    ],
    [for card in range(1, var.network_cards) : { card = card, device = 0, type = "efa-only" }],
  ) : [{ card = 0, device = 0, type = "interface" }]

  node_names = [for i in range(var.node_count) : format("%s-node-%02d", var.name_prefix, i)]
}

################################################################################
# IAM: SSM access instead of open SSH
################################################################################

data "aws_iam_policy_document" "assume_ec2" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "node" {
  name_prefix        = "${var.name_prefix}-node-"
  description        = "gpuprov GPU nodes: SSM Session Manager access"
  assume_role_policy = data.aws_iam_policy_document.assume_ec2.json
}

resource "aws_iam_role_policy_attachment" "ssm" {
  role       = aws_iam_role.node.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"
}

resource "aws_iam_instance_profile" "node" {
  name_prefix = "${var.name_prefix}-node-"
  role        = aws_iam_role.node.name
}

################################################################################
# Launch template
################################################################################

resource "aws_launch_template" "node" {
  name_prefix   = "${var.name_prefix}-"
  description   = "gpuprov ${var.instance_type} node with ${length(local.network_interfaces)} network interfaces"
  image_id      = local.ami_id
  instance_type = var.instance_type
  key_name      = var.key_name
  ebs_optimized = true

  iam_instance_profile {
    arn = aws_iam_instance_profile.node.arn
  }

  # IMDSv2 only; hop limit 1 keeps containers off the instance credentials.
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  monitoring {
    enabled = true
  }

  block_device_mappings {
    device_name = "/dev/sda1"

    ebs {
      volume_size           = var.root_volume_size_gib
      volume_type           = "gp3"
      encrypted             = true
      kms_key_id            = var.kms_key_arn
      delete_on_termination = true
    }
  }

  placement {
    group_name = aws_placement_group.cluster.name
  }

  # Nodes stay private: a public IP limits an instance to a single EFA interface.
  dynamic "network_interfaces" {
    for_each = local.network_interfaces
    content {
      network_card_index          = network_interfaces.value.card
      device_index                = network_interfaces.value.device
      interface_type              = network_interfaces.value.type
      subnet_id                   = var.subnet_id
      security_groups             = [aws_security_group.efa.id]
      associate_public_ip_address = false
      delete_on_termination       = true
    }
  }

  dynamic "capacity_reservation_specification" {
    for_each = var.capacity_reservation_id == null ? [] : [var.capacity_reservation_id]
    content {
      capacity_reservation_target {
        capacity_reservation_id = capacity_reservation_specification.value
      }
    }
  }

  # A Capacity Block for ML is bought as its own market type, on top of the reservation target.
  dynamic "instance_market_options" {
    for_each = var.capacity_block ? ["capacity-block"] : []
    content {
      market_type = instance_market_options.value
    }
  }

  tag_specifications {
    resource_type = "volume"
    tags          = var.tags
  }

  lifecycle {
    create_before_destroy = true

    precondition {
      condition     = var.capacity_reservation_id == null || var.availability_zone == data.aws_subnet.nodes.availability_zone
      error_message = "A capacity reservation lives in one availability zone: set availability_zone to it and pick a subnet_id in that zone."
    }
    precondition {
      condition     = !var.capacity_block || var.capacity_reservation_id != null
      error_message = "capacity_block = true needs capacity_reservation_id (the Capacity Block's reservation id)."
    }
  }
}

################################################################################
# Nodes
################################################################################

resource "aws_instance" "node" {
  count = var.node_count

  launch_template {
    id      = aws_launch_template.node.id
    version = aws_launch_template.node.latest_version
  }

  # Also stated here (the launch template carries them too) so each instance is explicit.
  iam_instance_profile = aws_iam_instance_profile.node.name
  ebs_optimized        = true
  monitoring           = true

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  root_block_device {
    volume_size = var.root_volume_size_gib
    volume_type = "gp3"
    encrypted   = true
    kms_key_id  = var.kms_key_arn
  }

  tags = {
    Name = local.node_names[count.index]
  }
}
