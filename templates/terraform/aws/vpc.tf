################################################################################
# Network the bundle brings (unless subnet_id names yours): a VPC with a private node subnet in the
# chosen zone, a public subnet holding the NAT gateway, and an S3 gateway endpoint
################################################################################
# The nodes have no public address (EFA allows a public IP on single-interface instances only):
# SSM Session Manager, apt, pip and the EFA installer reach out through the NAT gateway. A fresh
# account's default VPC has public subnets only, where none of that works.

locals {
  create_vpc = var.subnet_id == null
  subnet_id  = local.create_vpc ? one(aws_subnet.private[*].id) : var.subnet_id
  vpc_id     = local.create_vpc ? one(aws_vpc.this[*].id) : one(data.aws_subnet.nodes[*].vpc_id)
  vpc_cidr   = local.create_vpc ? var.vpc_cidr : one(data.aws_vpc.nodes[*].cidr_block)

  # The nodes' zone: the one you state (a reservation's zone), else the subnet's, else the first zone
  # of the region that offers the instance type.
  availability_zone = try(coalesce(var.availability_zone, one(data.aws_subnet.nodes[*].availability_zone), sort(one(data.aws_ec2_instance_type_offerings.zones[*].locations))[0]), null)
}

data "aws_subnet" "nodes" {
  count = local.create_vpc ? 0 : 1

  id = var.subnet_id
}

data "aws_vpc" "nodes" {
  count = local.create_vpc ? 0 : 1

  id = one(data.aws_subnet.nodes[*].vpc_id)
}

data "aws_ec2_instance_type_offerings" "zones" {
  count = local.create_vpc && var.availability_zone == null ? 1 : 0

  location_type = "availability-zone"

  filter {
    name   = "instance-type"
    values = [var.instance_type]
  }
}

resource "aws_vpc" "this" {
  #checkov:skip=CKV2_AWS_11:VPC flow logs need a log group or bucket and a role the cluster does not otherwise use; enable them account-wide if your policy requires them.
  count = local.create_vpc ? 1 : 0

  cidr_block           = var.vpc_cidr
  enable_dns_support   = true
  enable_dns_hostnames = true

  tags = {
    Name = "${var.name_prefix}-vpc"
  }
}

# The VPC's default security group allows nothing: the nodes use the EFA group (network.tf).
resource "aws_default_security_group" "this" {
  count = local.create_vpc ? 1 : 0

  vpc_id = aws_vpc.this[0].id
}

resource "aws_internet_gateway" "this" {
  count = local.create_vpc ? 1 : 0

  vpc_id = aws_vpc.this[0].id

  tags = {
    Name = "${var.name_prefix}-igw"
  }
}

resource "aws_subnet" "public" {
  count = local.create_vpc ? 1 : 0

  vpc_id            = aws_vpc.this[0].id
  cidr_block        = cidrsubnet(var.vpc_cidr, 8, 0)
  availability_zone = local.availability_zone

  tags = {
    Name = "${var.name_prefix}-public"
  }
}

# /20: the ENA primary interface of every node and FSx take addresses (efa-only interfaces take none).
resource "aws_subnet" "private" {
  count = local.create_vpc ? 1 : 0

  vpc_id            = aws_vpc.this[0].id
  cidr_block        = cidrsubnet(var.vpc_cidr, 4, 1)
  availability_zone = local.availability_zone

  tags = {
    Name = "${var.name_prefix}-private"
  }
}

resource "aws_eip" "nat" {
  count = local.create_vpc ? 1 : 0

  domain = "vpc"

  tags = {
    Name = "${var.name_prefix}-nat"
  }

  depends_on = [aws_internet_gateway.this]
}

resource "aws_nat_gateway" "this" {
  count = local.create_vpc ? 1 : 0

  allocation_id = aws_eip.nat[0].id
  subnet_id     = aws_subnet.public[0].id

  tags = {
    Name = "${var.name_prefix}-nat"
  }
}

resource "aws_route_table" "public" {
  count = local.create_vpc ? 1 : 0

  vpc_id = aws_vpc.this[0].id

  route {
    cidr_block = "0.0.0.0/0"
    gateway_id = aws_internet_gateway.this[0].id
  }

  tags = {
    Name = "${var.name_prefix}-public"
  }
}

resource "aws_route_table" "private" {
  count = local.create_vpc ? 1 : 0

  vpc_id = aws_vpc.this[0].id

  route {
    cidr_block     = "0.0.0.0/0"
    nat_gateway_id = aws_nat_gateway.this[0].id
  }

  tags = {
    Name = "${var.name_prefix}-private"
  }
}

resource "aws_route_table_association" "public" {
  count = local.create_vpc ? 1 : 0

  subnet_id      = aws_subnet.public[0].id
  route_table_id = aws_route_table.public[0].id
}

resource "aws_route_table_association" "private" {
  count = local.create_vpc ? 1 : 0

  subnet_id      = aws_subnet.private[0].id
  route_table_id = aws_route_table.private[0].id
}

# S3 (the AMI's packages, datasets, checkpoints copied out) without NAT data charges.
resource "aws_vpc_endpoint" "s3" {
  count = local.create_vpc ? 1 : 0

  vpc_id            = aws_vpc.this[0].id
  service_name      = "com.amazonaws.${var.region}.s3"
  vpc_endpoint_type = "Gateway"
  route_table_ids   = [aws_route_table.private[0].id]

  tags = {
    Name = "${var.name_prefix}-s3"
  }
}
