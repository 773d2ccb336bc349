################################################################################
# Head: a small VM with a public address in the bundle's public subnet, the SSH jump host
################################################################################
# The nodes stay private; Ansible and the operator reach them with ProxyJump through this VM
# (outputs.tf). Only bastion_cidr may SSH to it (the public subnet's security list). Created when
# the bundle brings its VCN; with your own subnet_id give bastion_host or ssh_cidr instead.

locals {
  head_enabled = var.create_head && var.bastion_host == null && local.create_vcn

  # The SSH jump to the nodes: your own bastion_host, else the head; null when neither (public nodes).
  jump_host = var.bastion_host != null ? var.bastion_host : (local.head_enabled ? "${var.ssh_user}@${one(oci_core_instance.head[*].public_ip)}" : null)
}

data "oci_core_images" "head" {
  count = local.head_enabled ? 1 : 0

  compartment_id           = var.compartment_ocid
  operating_system         = var.head_image.operating_system
  operating_system_version = var.head_image.operating_system_version
  shape                    = var.head_shape
  sort_by                  = "TIMECREATED"
  sort_order               = "DESC"
}

resource "oci_core_instance" "head" {
  count = local.head_enabled ? 1 : 0

  availability_domain = var.availability_domain
  compartment_id      = var.compartment_ocid
  display_name        = "${var.name_prefix}-head"
  shape               = var.head_shape
  freeform_tags       = local.freeform_tags

  shape_config {
    ocpus         = 1
    memory_in_gbs = 8
  }

  create_vnic_details {
    subnet_id        = oci_core_subnet.public[0].id
    assign_public_ip = true
  }

  source_details {
    source_type = "image"
    source_id   = data.oci_core_images.head[0].images[0].id
  }

  metadata = {
    ssh_authorized_keys = var.ssh_public_key
  }

  launch_options {
    is_pv_encryption_in_transit_enabled = true
  }

  # IMDSv2 only.
  instance_options {
    are_legacy_imds_endpoints_disabled = true
  }

  lifecycle {
    # A newer platform image must not replace the running jump host.
    ignore_changes = [source_details]

    precondition {
      condition     = var.bastion_cidr != null
      error_message = "The head (jump host) needs bastion_cidr: the CIDR allowed to SSH to it, e.g. your address/32. Or set create_head = false with ssh_cidr (public nodes) or bastion_host (your own jump host)."
    }
  }
}
