################################################################################
# Fabric: cluster placement group and the EFA security group
################################################################################

# All nodes in one placement group: EFA's low-latency path stays inside one network spine. Only for
# on-demand and spot nodes (main.tf: local.create_placement_group); the name carries the bundle id.
resource "aws_placement_group" "cluster" {
  count = local.create_placement_group ? 1 : 0

  name     = "${var.name_prefix}-cluster"
  strategy = "cluster"
}

resource "aws_security_group" "efa" {
  name_prefix = "${var.name_prefix}-efa-"
  description = "gpuprov GPU nodes: EFA needs all traffic to and from the group itself"
  vpc_id      = local.vpc_id

  lifecycle {
    create_before_destroy = true
  }
}

# EFA fails ("Unresponsive receiver") unless the group allows all traffic both ways within itself.
resource "aws_vpc_security_group_ingress_rule" "efa_self" {
  security_group_id            = aws_security_group.efa.id
  referenced_security_group_id = aws_security_group.efa.id
  ip_protocol                  = "-1"
  description                  = "EFA and NCCL: all traffic from the other nodes"
}

resource "aws_vpc_security_group_egress_rule" "efa_self" {
  security_group_id            = aws_security_group.efa.id
  referenced_security_group_id = aws_security_group.efa.id
  ip_protocol                  = "-1"
  description                  = "EFA and NCCL: all traffic to the other nodes"
}

# Package mirrors, the EFA installer, container registries and SSM endpoints (through the VPC's NAT).
resource "aws_vpc_security_group_egress_rule" "https" {
  security_group_id = aws_security_group.efa.id
  cidr_ipv4         = "0.0.0.0/0"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  description       = "HTTPS out: packages, registries, SSM"
}

resource "aws_vpc_security_group_egress_rule" "http" {
  security_group_id = aws_security_group.efa.id
  cidr_ipv4         = "0.0.0.0/0"
  ip_protocol       = "tcp"
  from_port         = 80
  to_port           = 80
  description       = "HTTP out: Ubuntu apt mirrors"
}

# Shared filesystems in the VPC: Lustre (FSx: 988 and 1018-1023) and NFS (2049).
resource "aws_vpc_security_group_egress_rule" "lustre" {
  security_group_id = aws_security_group.efa.id
  cidr_ipv4         = local.vpc_cidr
  ip_protocol       = "tcp"
  from_port         = 988
  to_port           = 988
  description       = "Lustre clients to FSx for Lustre servers"
}

resource "aws_vpc_security_group_egress_rule" "lustre_ports" {
  security_group_id = aws_security_group.efa.id
  cidr_ipv4         = local.vpc_cidr
  ip_protocol       = "tcp"
  from_port         = 1018
  to_port           = 1023
  description       = "Lustre clients to FSx for Lustre servers (reserved ports)"
}

resource "aws_vpc_security_group_egress_rule" "nfs" {
  security_group_id = aws_security_group.efa.id
  cidr_ipv4         = local.vpc_cidr
  ip_protocol       = "tcp"
  from_port         = 2049
  to_port           = 2049
  description       = "NFS clients to file servers in the VPC"
}
