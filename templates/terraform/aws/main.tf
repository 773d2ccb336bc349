# GPU nodes for the gpuprov plan: one EC2 instance per node, all from one launch template that
# carries the EFA interfaces, the placement group, and the purchase option (on-demand, spot, an
# On-Demand Capacity Reservation or a Capacity Block for ML).

provider "aws" {
  region = var.region

  default_tags {
    tags = local.tags
  }
}

# Owner and expiry on every resource: who to ask, and when a forgotten cluster may be deleted.
locals {
  tags = merge(var.tags, { for k, v in { owner = var.owner, expires-on = var.expires_on } : k => v if v != null })
}

################################################################################
# Lookups
################################################################################

data "aws_partition" "current" {}

# The GPU image (AWS Deep Learning Base OSS Nvidia Driver AMI: driver, EFA, NCCL installed), read
# from its public SSM parameter only when no ami_id is given.
data "aws_ssm_parameter" "ami" {
  count = var.ami_id == null ? 1 : 0

  name = var.ami_ssm_parameter
}

# The first apply pins the AMI the parameter named then: a newer release changes nothing, so nodes
# added later boot the same driver and EFA stack as the running ones. Set ami_id to move on.
resource "terraform_data" "ami" {
  input = one(data.aws_ssm_parameter.ami[*].insecure_value)

  lifecycle {
    ignore_changes = [input]
  }
}

data "aws_ami" "node" {
  filter {
    name   = "image-id"
    values = [local.ami_id]
  }
}

locals {
  ami_id = var.ami_id != null ? var.ami_id : terraform_data.ami.output

  # The purchase option as EC2 market type: spot and Capacity Blocks are market types, on-demand and
  # an ODCR (a capacity reservation target) are not.
  market_type = lookup({ spot = "spot", "capacity-block" = "capacity-block" }, var.purchase_option, null)

  # A placement group of the bundle's own only for pay-as-you-go nodes: a Capacity Block or an ODCR
  # carries its own placement, and a second group conflicts with it (insufficient capacity).
  create_placement_group = var.placement_group_name == null && contains(["on-demand", "spot"], var.purchase_option) && var.node_count > 1
  placement_group        = var.placement_group_name != null ? var.placement_group_name : one(aws_placement_group.cluster[*].name)

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

  # How Ansible reaches the private nodes from a laptop: SSH through SSM Session Manager.
  ssh_proxy = "${var.ssh_proxy_command} --region ${var.region}"
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
  #checkov:skip=CKV_AWS_341:Containers on the nodes (NCCL tests, training images) reach IMDSv2 through one more network hop; hop limit 2 is what AWS documents for containers, and tokens stay required.
  name_prefix   = "${var.name_prefix}-"
  description   = "gpuprov ${var.instance_type} node with ${length(local.network_interfaces)} network interfaces"
  image_id      = local.ami_id
  instance_type = var.instance_type
  key_name      = var.key_name
  ebs_optimized = true

  iam_instance_profile {
    arn = aws_iam_instance_profile.node.arn
  }

  # IMDSv2 only; hop limit 2 so that containers on the node reach it too.
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 2
  }

  monitoring {
    enabled = true
  }

  block_device_mappings {
    device_name = data.aws_ami.node.root_device_name

    ebs {
      volume_size           = var.root_volume_size_gib
      volume_type           = "gp3"
      encrypted             = true
      kms_key_id            = var.kms_key_arn
      delete_on_termination = true
    }
  }

  placement {
    group_name = local.placement_group
  }

  # Nodes stay private: a public IP limits an instance to a single EFA interface.
  dynamic "network_interfaces" {
    for_each = local.network_interfaces
    content {
      network_card_index          = network_interfaces.value.card
      device_index                = network_interfaces.value.device
      interface_type              = network_interfaces.value.type
      subnet_id                   = local.subnet_id
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

  # Spot and Capacity Blocks for ML are market types; a Capacity Block also targets its reservation.
  dynamic "instance_market_options" {
    for_each = local.market_type == null ? [] : [local.market_type]
    content {
      market_type = instance_market_options.value

      dynamic "spot_options" {
        for_each = instance_market_options.value == "spot" ? ["one-time"] : []
        content {
          spot_instance_type             = spot_options.value
          instance_interruption_behavior = "terminate"
        }
      }
    }
  }

  tag_specifications {
    resource_type = "volume"
    tags          = local.tags
  }

  # Every node has one interface per network card (33 on p5): owner and expiry on each of them too.
  tag_specifications {
    resource_type = "network-interface"
    tags          = local.tags
  }

  lifecycle {
    create_before_destroy = true

    precondition {
      condition     = var.capacity_reservation_id == null || var.availability_zone != null
      error_message = "A capacity reservation lives in one availability zone: set availability_zone to it (aws ec2 describe-capacity-reservations --capacity-reservation-ids ID --query 'CapacityReservations[0].AvailabilityZone')."
    }
    precondition {
      condition     = local.create_vpc || var.availability_zone == null || var.availability_zone == one(data.aws_subnet.nodes[*].availability_zone)
      error_message = "subnet_id is not in availability_zone: pick a subnet in that zone, or leave subnet_id unset and the bundle creates one there."
    }
    precondition {
      condition     = local.availability_zone != null
      error_message = "No availability zone of the region offers instance_type: pick another region or instance type."
    }
    precondition {
      condition     = (var.capacity_reservation_id != null) == contains(["reservation", "capacity-block"], var.purchase_option)
      error_message = "purchase_option reservation and capacity-block need capacity_reservation_id (the ODCR or Capacity Block id); the other options take none."
    }
    precondition {
      condition     = var.purchase_option != "capacity-block" || var.placement_group_name == null
      error_message = "A Capacity Block brings its own placement: leave placement_group_name unset."
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
    http_put_response_hop_limit = 2
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

  # A new AMI or launch template version applies to new nodes only: replacing a running node would
  # wipe its local NVMe scratch in the middle of a run.
  lifecycle {
    ignore_changes = [ami, launch_template]
  }
}
