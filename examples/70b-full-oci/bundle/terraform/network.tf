################################################################################
# Fabric: cluster network (RDMA over converged Ethernet between the bare-metal nodes)
################################################################################
# The front-end subnet is the user's (subnet_id); OCI wires the RDMA NICs of every instance in
# the cluster network to one non-blocking RDMA fabric.

resource "oci_core_cluster_network" "this" {
  compartment_id = var.compartment_ocid
  display_name   = "${var.name_prefix}-cluster"
  freeform_tags  = var.freeform_tags

  instance_pools {
    instance_configuration_id = oci_core_instance_configuration.node.id
    size                      = var.node_count
    display_name              = "${var.name_prefix}-pool"
  }

  placement_configuration {
    availability_domain = var.availability_domain
    primary_subnet_id   = var.subnet_id
  }

  timeouts {
    create = "120m"
  }
}

# Instance ids, names and private IPs for the outputs.
data "oci_core_instance_pool_instances" "nodes" {
  compartment_id   = var.compartment_ocid
  instance_pool_id = oci_core_cluster_network.this.instance_pools[0].id
}

data "oci_core_instance" "nodes" {
  count = var.node_count

  instance_id = data.oci_core_instance_pool_instances.nodes.instances[count.index].id
}
