################################################################################
# Fabric: cluster network (RDMA over converged Ethernet between the bare-metal nodes)
################################################################################
# The front-end subnet is the bundle's (vcn.tf) or the user's (subnet_id); OCI wires the RDMA NICs
# of every instance in the cluster network to one non-blocking RDMA fabric.

# The front-end subnet's default security list allows SSH and ICMP only: NCCL bootstrap, torchrun's
# rendezvous and the shared filesystem need all traffic between the nodes (an NSG self rule,
# stateless both ways: no connection tracking on the nodes' own traffic).
resource "oci_core_network_security_group" "nodes" {
  compartment_id = var.compartment_ocid
  vcn_id         = local.vcn_id
  display_name   = "${var.name_prefix}-nodes"
  freeform_tags  = local.freeform_tags
}

resource "oci_core_network_security_group_security_rule" "self_ingress" {
  #checkov:skip=CKV2_OCI_2:The source is the nodes' own NSG, not the internet: RDP (like every port) is open only between the cluster's nodes, which NCCL and the rendezvous need.
  network_security_group_id = oci_core_network_security_group.nodes.id
  direction                 = "INGRESS"
  protocol                  = "all"
  stateless                 = true
  source_type               = "NETWORK_SECURITY_GROUP"
  source                    = oci_core_network_security_group.nodes.id
  description               = "All traffic from the other nodes (NCCL, rendezvous, NFS)"
}

resource "oci_core_network_security_group_security_rule" "self_egress" {
  #checkov:skip=CKV2_OCI_2:The destination is the nodes' own NSG: all ports are open only between the cluster's nodes, which NCCL and the rendezvous need.
  network_security_group_id = oci_core_network_security_group.nodes.id
  direction                 = "EGRESS"
  protocol                  = "all"
  stateless                 = true
  destination_type          = "NETWORK_SECURITY_GROUP"
  destination               = oci_core_network_security_group.nodes.id
  description               = "All traffic to the other nodes (NCCL, rendezvous, NFS)"
}

resource "oci_core_network_security_group_security_rule" "ssh" {
  #checkov:skip=CKV_OCI_21:SSH from the operator's CIDR is stateful on purpose: a stateless rule would need an egress rule for the replies to that CIDR, and connection tracking of one operator's sessions costs nothing.
  count = var.ssh_cidr == null ? 0 : 1

  network_security_group_id = oci_core_network_security_group.nodes.id
  direction                 = "INGRESS"
  protocol                  = "6"
  source_type               = "CIDR_BLOCK"
  source                    = var.ssh_cidr
  description               = "SSH from the operator's network"

  tcp_options {
    destination_port_range {
      min = 22
      max = 22
    }
  }
}

resource "oci_core_cluster_network" "this" {
  compartment_id = var.compartment_ocid
  display_name   = "${var.name_prefix}-cluster"
  freeform_tags  = local.freeform_tags

  instance_pools {
    instance_configuration_id = oci_core_instance_configuration.node.id
    size                      = var.node_count
    display_name              = "${var.name_prefix}-pool"
  }

  placement_configuration {
    availability_domain = var.availability_domain
    primary_subnet_id   = local.node_subnet_id
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
