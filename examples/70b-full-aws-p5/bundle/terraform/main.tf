# GPU nodes for the gpuprov plan: one EC2 Fleet request of type instant for every node, all from one
# launch template that carries the EFA interfaces, the placement group and the capacity reservation.
# The fleet's minimum target capacity is the node count: EC2 launches every node or none, so a
# capacity error leaves no node running and billing (aws-parallelcluster-node's fleet_manager.py
# launches a job's nodes the same way: CreateFleet, Type instant, MinTargetCapacity = the count).

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
  # The fleet's default target capacity type: on-demand also for an ODCR.
  capacity_type = coalesce(local.market_type, "on-demand")

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

  # A Capacity Block for ML is a market type of the launch template; spot is the fleet's capacity
  # type (its spot_options), as ParallelCluster's fleet requests set it.
  dynamic "instance_market_options" {
    for_each = local.market_type == "capacity-block" ? [local.market_type] : []
    content {
      market_type = instance_market_options.value
    }
  }

  # Tags of the fleet's instances: provider default_tags reach the fleet resource, not what it launches.
  tag_specifications {
    resource_type = "instance"
    tags          = local.tags
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
# Nodes: one EC2 Fleet request
################################################################################

# An instant fleet is a one-time request that EC2 cannot modify (ModifyFleet takes maintain fleets
# only), while the provider would update its capacity in place: a new size or capacity type
# replaces the fleet instead, a new all-or-nothing request.
resource "terraform_data" "fleet_request" {
  input = { node_count = var.node_count, capacity_type = local.capacity_type }
}

# One all-or-nothing request: total and minimum target capacity are both node_count, in one instance
# type and one zone (the launch template's subnet).
resource "aws_ec2_fleet" "nodes" {
  type                = "instant"
  terminate_instances = true # destroy (gpuprov down) terminates the nodes the fleet launched

  launch_template_config {
    launch_template_specification {
      launch_template_id = aws_launch_template.node.id
      version            = aws_launch_template.node.latest_version
    }
  }

  target_capacity_specification {
    default_target_capacity_type = local.capacity_type
    total_target_capacity        = var.node_count
  }

  dynamic "on_demand_options" {
    for_each = local.capacity_type == "spot" ? [] : [var.node_count]
    content {
      min_target_capacity      = on_demand_options.value
      single_instance_type     = true
      single_availability_zone = true

      # An ODCR: the launch template targets it; the fleet is told to use it before open capacity.
      dynamic "capacity_reservation_options" {
        for_each = var.purchase_option == "reservation" ? ["use-capacity-reservations-first"] : []
        content {
          usage_strategy = capacity_reservation_options.value
        }
      }
    }
  }

  dynamic "spot_options" {
    for_each = local.capacity_type == "spot" ? [var.node_count] : []
    content {
      min_target_capacity            = spot_options.value
      single_instance_type           = true
      single_availability_zone       = true
      instance_interruption_behavior = "terminate"
    }
  }

  # A new AMI or launch template version applies to new nodes only: replacing the fleet would
  # terminate every running node and wipe its local NVMe scratch in the middle of a run.
  lifecycle {
    ignore_changes       = [launch_template_config]
    replace_triggered_by = [terraform_data.fleet_request]
  }
}

# Node i's instance, pinned when the fleet launches: the fleet lists its instances per launch pool in
# no set order (sorted, node i is always the same), and what DescribeFleets lists once EC2 has
# terminated one is not documented. A new fleet request (a new id) launches every node again and pins
# them anew.
resource "terraform_data" "fleet_nodes" {
  input = zipmap(local.node_names, sort(flatten(aws_ec2_fleet.nodes.fleet_instance_set[*].instance_ids)))

  lifecycle {
    ignore_changes       = [input]
    replace_triggered_by = [aws_ec2_fleet.nodes.id]
  }
}

################################################################################
# Lost nodes: each replaced under its name
################################################################################

locals {
  # A reclaimed spot node or a dead host is terminated and the instant fleet never replaces it.
  # `gpuprov up` finds such nodes (their instances terminated) and lists them in
  # replaced_nodes.auto.tfvars.json; each gets an instance of its own from the same launch template,
  # under the same name, and no other node is touched. The list holds for the fleet request it was
  # made under: a new node count or purchase option launches a new fleet for every node.
  replaced = toset(var.replaced_nodes == null ? [] : (
    var.replaced_nodes.node_count == var.node_count && var.replaced_nodes.purchase_option == var.purchase_option
    ? [for name in local.node_names : name if contains(var.replaced_nodes.names, name)] : []
  ))
  fleet_names = [for name in local.node_names : name if !contains(local.replaced, name)]
}

resource "aws_instance" "replacement" {
  #checkov:skip=CKV_AWS_79:IMDSv2 is required by the nodes' launch template (metadata_options http_tokens = "required"), which this instance launches from.
  #checkov:skip=CKV_AWS_135:EBS optimisation is set in the nodes' launch template (ebs_optimized = true), which this instance launches from.
  #checkov:skip=CKV_AWS_8:The root volume is encrypted by the nodes' launch template (encrypted = true), which this instance launches from.
  #checkov:skip=CKV_AWS_126:Detailed monitoring is enabled by the nodes' launch template (monitoring enabled = true), which this instance launches from.
  #checkov:skip=CKV2_AWS_41:The nodes' IAM instance profile is attached by the launch template this instance launches from.
  for_each = local.replaced

  launch_template {
    id      = aws_launch_template.node.id
    version = aws_launch_template.node.latest_version
  }

  # Spot is the fleet's capacity type, not the launch template's: a spot node is replaced by a spot
  # node, terminated on interruption as the fleet's were.
  dynamic "instance_market_options" {
    for_each = local.capacity_type == "spot" ? [local.capacity_type] : []
    content {
      market_type = instance_market_options.value

      spot_options {
        instance_interruption_behavior = "terminate"
        spot_instance_type             = "one-time"
      }
    }
  }

  tags = { Name = each.key }

  # A new AMI or launch template version applies to nodes launched later, as for the fleet.
  lifecycle {
    ignore_changes = [launch_template]
  }
}

# Each fleet node's name, as its Name tag (the fleet tags every instance alike; a replacement carries its own).
resource "aws_ec2_tag" "node_name" {
  for_each = toset(local.fleet_names)

  resource_id = terraform_data.fleet_nodes.output[each.key]
  key         = "Name"
  value       = each.key
}

# Each fleet node's address: read per instance id once the fleet has launched (unknown during the
# first plan). A replaced node's terminated instance is not read.
data "aws_instance" "node" {
  for_each = toset(local.fleet_names)

  instance_id = terraform_data.fleet_nodes.output[each.key]
}

locals {
  node_addresses = merge(
    { for name, node in data.aws_instance.node : name => { id = node.id, private_ip = node.private_ip } },
    { for name, node in aws_instance.replacement : name => { id = node.id, private_ip = node.private_ip } },
  )
  # What every output reads: the nodes in node order.
  nodes = [for name in local.node_names : merge({ name = name }, local.node_addresses[name])]
}
