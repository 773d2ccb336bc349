################################################################################
# Host network: primary VPC, Cloud NAT for egress (no external IPs), internal and SSH rules
################################################################################

resource "google_compute_network" "primary" {
  name                    = "${var.name_prefix}-net"
  auto_create_subnetworks = false
  mtu                     = var.gpu_network_mtu
}

resource "google_compute_subnetwork" "primary" {
  name                     = "${var.name_prefix}-subnet"
  network                  = google_compute_network.primary.id
  region                   = var.region
  ip_cidr_range            = var.primary_cidr
  private_ip_google_access = true

  # Flow logs on the host network only, sampled lightly: they cost by volume.
  log_config {
    aggregation_interval = "INTERVAL_5_MIN"
    flow_sampling        = 0.1
    metadata             = "INCLUDE_ALL_METADATA"
  }
}

resource "google_compute_router" "nat" {
  name    = "${var.name_prefix}-router"
  network = google_compute_network.primary.id
  region  = var.region
}

resource "google_compute_router_nat" "nat" {
  name                               = "${var.name_prefix}-nat"
  router                             = google_compute_router.nat.name
  region                             = var.region
  nat_ip_allocate_option             = "AUTO_ONLY"
  source_subnetwork_ip_ranges_to_nat = "ALL_SUBNETWORKS_ALL_IP_RANGES"

  log_config {
    enable = true
    filter = "ERRORS_ONLY"
  }
}

resource "google_compute_firewall" "primary_internal" {
  name          = "${var.name_prefix}-internal"
  network       = google_compute_network.primary.id
  direction     = "INGRESS"
  source_ranges = [var.primary_cidr]

  allow {
    protocol = "all"
  }
}

# SSH through IAP TCP forwarding (how Ansible reaches the nodes), plus the operator's CIDR if given.
resource "google_compute_firewall" "ssh" {
  name          = "${var.name_prefix}-ssh"
  network       = google_compute_network.primary.id
  direction     = "INGRESS"
  source_ranges = concat([var.iap_cidr], var.ssh_cidr == null ? [] : [var.ssh_cidr])

  allow {
    protocol = "tcp"
    ports    = ["22"]
  }
}

################################################################################
# Fabric: gVNIC data networks (GPUDirect-TCPX/TCPXO, one VPC per NIC)
################################################################################

resource "google_compute_network" "gpu" {
  count = var.gpu_nic_count

  name                    = format("%s-gpu-%d", var.name_prefix, count.index)
  auto_create_subnetworks = false
  mtu                     = var.gpu_network_mtu
}

resource "google_compute_subnetwork" "gpu" {
  #checkov:skip=CKV_GCP_26:GPU data subnets carry only GPUDirect-TCPX/TCPXO traffic between the nodes; flow logs there would bill for terabytes of NCCL traffic and diagnose nothing (the host subnet keeps them).
  count = var.gpu_nic_count

  name                     = format("%s-gpu-%d", var.name_prefix, count.index)
  network                  = google_compute_network.gpu[count.index].id
  region                   = var.region
  ip_cidr_range            = cidrsubnet(var.gpu_cidr, 8, count.index)
  private_ip_google_access = true
}

resource "google_compute_firewall" "gpu_internal" {
  count = var.gpu_nic_count

  name          = format("%s-gpu-%d-internal", var.name_prefix, count.index)
  network       = google_compute_network.gpu[count.index].id
  direction     = "INGRESS"
  source_ranges = [google_compute_subnetwork.gpu[count.index].ip_cidr_range]

  allow {
    protocol = "all"
  }
}

################################################################################
# Fabric: RoCE VPC (a3-ultragpu / a4): one subnet per MRDMA NIC
################################################################################

resource "google_compute_network" "rdma" {
  #checkov:skip=CKV2_GCP_18:RoCE VPC networks do not support VPC firewall rules (only RDMA_ROCE_POLICY regional firewall policies); the network carries only RDMA traffic between the nodes' MRDMA NICs.
  count = var.rdma_nic_count > 0 ? 1 : 0

  name                    = "${var.name_prefix}-rdma"
  auto_create_subnetworks = false
  mtu                     = var.gpu_network_mtu
  network_profile         = "https://www.googleapis.com/compute/beta/projects/${var.project_id}/global/networkProfiles/${var.zone}-vpc-roce"
}

resource "google_compute_subnetwork" "rdma" {
  #checkov:skip=CKV_GCP_26:RoCE subnets serve only MRDMA NICs doing GPU-to-GPU RDMA, which VPC Flow Logs do not sample (cluster-toolkit's gpu-rdma-vpc creates them without logs too).
  #checkov:skip=CKV_GCP_74:RoCE subnets carry no IP traffic to Google APIs (only RDMA between MRDMA NICs), so Private Google Access has nothing to serve.
  count = var.rdma_nic_count

  name          = format("%s-rdma-%d", var.name_prefix, count.index)
  network       = google_compute_network.rdma[0].id
  region        = var.region
  ip_cidr_range = cidrsubnet(var.rdma_cidr, 8, count.index)
}
