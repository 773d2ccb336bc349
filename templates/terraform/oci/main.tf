# GPU nodes for the gpuprov plan: bare-metal GPU shapes in an OCI cluster network (network.tf),
# launched from one instance configuration with the HPC RDMA agent plugins enabled.

provider "oci" {
  region = var.region
}

# Owner and expiry on every resource: who to ask, and when a forgotten cluster may be deleted.
locals {
  freeform_tags = merge(var.freeform_tags, { for k, v in { owner = var.owner, expires-on = var.expires_on } : k => v if v != null })
}

locals {
  # Oracle Cloud Agent plugins that authenticate and configure the RDMA NICs of a cluster network,
  # plus the GPU/RDMA health monitor.
  rdma_plugins = [
    "Compute HPC RDMA Authentication",
    "Compute HPC RDMA Auto-Configuration",
    "Compute RDMA GPU Monitoring",
  ]

  node_names = [for i in range(var.node_count) : format("%s-node-%02d", var.name_prefix, i)]
}

################################################################################
# GPU image: your image_id, or Oracle's GPU image imported from its published link
# (Oracle publishes a download link per image, not an OCID per region).
################################################################################

resource "oci_core_image" "gpu" {
  count = var.image_id == null ? 1 : 0

  compartment_id = var.compartment_ocid
  display_name   = "${var.name_prefix}-gpu-image"
  freeform_tags  = local.freeform_tags

  image_source_details {
    source_type = "objectStorageUri"
    source_uri  = var.image_uri
  }

  timeouts {
    create = "90m" # an import copies the whole image into the region
  }

  lifecycle {
    precondition {
      condition     = var.image_uri != null
      error_message = "Set image_id (an Ubuntu 22.04 image OCID for the shape) or image_uri in terraform.tfvars."
    }
  }
}

# An imported image is not compatible with any shape until it is told so.
resource "oci_core_shape_management" "gpu" {
  count = var.image_id == null ? 1 : 0

  compartment_id = var.compartment_ocid
  image_id       = oci_core_image.gpu[0].id
  shape_name     = var.shape
}

locals {
  image_id = var.image_id != null ? var.image_id : oci_core_shape_management.gpu[0].image_id
}

################################################################################
# Instance configuration
################################################################################

resource "oci_core_instance_configuration" "node" {
  compartment_id = var.compartment_ocid
  display_name   = "${var.name_prefix}-node"
  freeform_tags  = local.freeform_tags

  instance_details {
    instance_type = "compute"

    launch_details {
      availability_domain                 = var.availability_domain
      compartment_id                      = var.compartment_ocid
      shape                               = var.shape
      is_pv_encryption_in_transit_enabled = true
      freeform_tags                       = local.freeform_tags

      metadata = {
        ssh_authorized_keys = var.ssh_public_key
      }

      # Nodes stay private (the subnet's NAT gateway serves package downloads) unless ssh_cidr is
      # given: then each gets a public address in a subnet that allows one, and only that CIDR may
      # SSH to it (network.tf).
      create_vnic_details {
        subnet_id        = local.node_subnet_id
        assign_public_ip = var.ssh_cidr != null
        nsg_ids          = [oci_core_network_security_group.nodes.id]
      }

      source_details {
        source_type             = "image"
        image_id                = local.image_id
        boot_volume_size_in_gbs = var.boot_volume_size_gb
      }

      # IMDSv2 only.
      instance_options {
        are_legacy_imds_endpoints_disabled = true
      }

      agent_config {
        are_all_plugins_disabled = false
        is_management_disabled   = false
        is_monitoring_disabled   = false

        dynamic "plugins_config" {
          for_each = local.rdma_plugins
          content {
            name          = plugins_config.value
            desired_state = "ENABLED"
          }
        }
      }
    }
  }

  # A new image or SSH key makes a new configuration: the cluster network's pool moves to it before
  # the old one is deleted (deleting a configuration a pool still uses fails half-way).
  lifecycle {
    create_before_destroy = true

    precondition {
      condition     = var.ssh_cidr == null || local.create_vcn || !one(data.oci_core_subnet.nodes[*].prohibit_public_ip_on_vnic)
      error_message = "ssh_cidr gives the nodes public addresses, which subnet_id prohibits (a private subnet): name a public subnet, or drop ssh_cidr and reach the nodes through bastion_host."
    }
  }
}
