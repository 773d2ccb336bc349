################################################################################
# Network the bundle brings (unless subnet_id names yours): a VCN with a public subnet for the head
# and a private node subnet whose egress runs through a NAT gateway (packages, images, pip)
################################################################################

locals {
  create_vcn = var.subnet_id == null
  vcn_id     = local.create_vcn ? one(oci_core_vcn.this[*].id) : one(data.oci_core_subnet.nodes[*].vcn_id)

  # Public node addresses (ssh_cidr) need a subnet that allows them: the bundle's public subnet.
  node_subnet_id = local.create_vcn ? (var.ssh_cidr == null ? one(oci_core_subnet.private[*].id) : one(oci_core_subnet.public[*].id)) : var.subnet_id

  # CIDRs allowed to SSH into the public subnet (the head, and public nodes under ssh_cidr).
  ssh_sources = [for cidr in [var.bastion_cidr, var.ssh_cidr] : cidr if cidr != null]
}

data "oci_core_subnet" "nodes" {
  count = local.create_vcn ? 0 : 1

  subnet_id = var.subnet_id
}

resource "oci_core_vcn" "this" {
  count = local.create_vcn ? 1 : 0

  compartment_id = var.compartment_ocid
  cidr_blocks    = [var.vcn_cidr]
  display_name   = "${var.name_prefix}-vcn"
  freeform_tags  = local.freeform_tags
}

resource "oci_core_internet_gateway" "this" {
  count = local.create_vcn ? 1 : 0

  compartment_id = var.compartment_ocid
  vcn_id         = oci_core_vcn.this[0].id
  enabled        = true
  display_name   = "${var.name_prefix}-igw"
  freeform_tags  = local.freeform_tags
}

resource "oci_core_nat_gateway" "this" {
  count = local.create_vcn ? 1 : 0

  compartment_id = var.compartment_ocid
  vcn_id         = oci_core_vcn.this[0].id
  display_name   = "${var.name_prefix}-nat"
  freeform_tags  = local.freeform_tags
}

resource "oci_core_route_table" "public" {
  count = local.create_vcn ? 1 : 0

  compartment_id = var.compartment_ocid
  vcn_id         = oci_core_vcn.this[0].id
  display_name   = "${var.name_prefix}-public"
  freeform_tags  = local.freeform_tags

  route_rules {
    destination       = "0.0.0.0/0"
    destination_type  = "CIDR_BLOCK"
    network_entity_id = oci_core_internet_gateway.this[0].id
  }
}

resource "oci_core_route_table" "private" {
  count = local.create_vcn ? 1 : 0

  compartment_id = var.compartment_ocid
  vcn_id         = oci_core_vcn.this[0].id
  display_name   = "${var.name_prefix}-private"
  freeform_tags  = local.freeform_tags

  route_rules {
    destination       = "0.0.0.0/0"
    destination_type  = "CIDR_BLOCK"
    network_entity_id = oci_core_nat_gateway.this[0].id
  }
}

# The VCN's default security list would admit SSH from anywhere: each subnet gets its own list.
resource "oci_core_security_list" "public" {
  count = local.create_vcn ? 1 : 0

  compartment_id = var.compartment_ocid
  vcn_id         = oci_core_vcn.this[0].id
  display_name   = "${var.name_prefix}-public"
  freeform_tags  = local.freeform_tags

  egress_security_rules {
    destination = "0.0.0.0/0"
    protocol    = "all"
  }

  ingress_security_rules {
    source   = var.vcn_cidr
    protocol = "all"
  }

  dynamic "ingress_security_rules" {
    for_each = local.ssh_sources
    content {
      source   = ingress_security_rules.value
      protocol = "6"

      tcp_options {
        min = 22
        max = 22
      }
    }
  }
}

resource "oci_core_security_list" "private" {
  count = local.create_vcn ? 1 : 0

  compartment_id = var.compartment_ocid
  vcn_id         = oci_core_vcn.this[0].id
  display_name   = "${var.name_prefix}-private"
  freeform_tags  = local.freeform_tags

  egress_security_rules {
    destination = "0.0.0.0/0"
    protocol    = "all"
  }

  # The head's SSH, NCCL's bootstrap and the rendezvous stay inside the VCN.
  ingress_security_rules {
    source   = var.vcn_cidr
    protocol = "all"
  }
}

resource "oci_core_subnet" "public" {
  count = local.create_vcn ? 1 : 0

  compartment_id             = var.compartment_ocid
  vcn_id                     = oci_core_vcn.this[0].id
  cidr_block                 = cidrsubnet(var.vcn_cidr, 8, 0)
  display_name               = "${var.name_prefix}-public"
  route_table_id             = oci_core_route_table.public[0].id
  security_list_ids          = [oci_core_security_list.public[0].id]
  prohibit_public_ip_on_vnic = false
  freeform_tags              = local.freeform_tags
}

resource "oci_core_subnet" "private" {
  count = local.create_vcn ? 1 : 0

  compartment_id             = var.compartment_ocid
  vcn_id                     = oci_core_vcn.this[0].id
  cidr_block                 = cidrsubnet(var.vcn_cidr, 8, 1)
  display_name               = "${var.name_prefix}-private"
  route_table_id             = oci_core_route_table.private[0].id
  security_list_ids          = [oci_core_security_list.private[0].id]
  prohibit_public_ip_on_vnic = true
  freeform_tags              = local.freeform_tags
}
