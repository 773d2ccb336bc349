# GPU nodes for the gpuprov plan: one Compute Engine VM per node, compact placement, a NIC per
# fabric network (network.tf), no external IPs, host maintenance stops the VM (GPUs cannot migrate).

provider "google" {
  project        = var.project_id
  region         = var.region
  zone           = var.zone
  default_labels = var.labels
}

locals {
  node_names = [for i in range(var.node_count) : format("%s-node-%02d", var.name_prefix, i)]

  # NIC order matters to the guest: nic0 is the primary gVNIC, then the gVNIC data networks
  # (TCPX/TCPXO, or the second host network on RoCE machines), then one MRDMA NIC per RoCE subnet.
  nics = concat(
    [{ subnetwork = google_compute_subnetwork.primary.id, nic_type = "GVNIC" }],
    [for s in google_compute_subnetwork.gpu : { subnetwork = s.id, nic_type = "GVNIC" }],
    [for s in google_compute_subnetwork.rdma : { subnetwork = s.id, nic_type = "MRDMA" }],
  )
}

################################################################################
# Placement
################################################################################

# Compact placement keeps the nodes close in the data-centre network (lower latency for NCCL).
resource "google_compute_resource_policy" "placement" {
  count = var.compact_placement ? 1 : 0

  name   = "${var.name_prefix}-compact"
  region = var.region

  group_placement_policy {
    collocation = "COLLOCATED"
    vm_count    = var.node_count
  }
}

################################################################################
# Nodes
################################################################################

resource "google_compute_instance" "node" {
  #checkov:skip=CKV_GCP_38:Customer-supplied keys would have to sit in the Terraform state and be resent on every disk operation; boot disks hold only the OS and drivers and keep Google-managed encryption at rest (set kms_key_self_link for CMEK).
  count = var.node_count

  name              = local.node_names[count.index]
  machine_type      = var.machine_type
  zone              = var.zone
  resource_policies = google_compute_resource_policy.placement[*].id
  labels            = var.labels

  boot_disk {
    initialize_params {
      image = var.image
      size  = var.boot_disk_size_gb
      type  = var.boot_disk_type
    }
    kms_key_self_link = var.kms_key_self_link
  }

  dynamic "network_interface" {
    for_each = local.nics
    content {
      subnetwork = network_interface.value.subnetwork
      nic_type   = network_interface.value.nic_type
    }
  }

  # GPU VMs cannot live-migrate: stop on host maintenance and come back afterwards.
  scheduling {
    on_host_maintenance = "TERMINATE"
    automatic_restart   = true
  }

  dynamic "reservation_affinity" {
    for_each = var.reservation_name == null ? [] : [var.reservation_name]
    content {
      type = "SPECIFIC_RESERVATION"

      specific_reservation {
        key    = "compute.googleapis.com/reservation-name"
        values = [reservation_affinity.value]
      }
    }
  }

  dynamic "service_account" {
    for_each = var.service_account_email == null ? [] : [var.service_account_email]
    content {
      email  = service_account.value
      scopes = ["cloud-platform"]
    }
  }

  shielded_instance_config {
    enable_secure_boot          = var.secure_boot
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  # OS Login only: no project-wide SSH keys, no serial console.
  metadata = {
    enable-oslogin         = "TRUE"
    block-project-ssh-keys = "true"
    serial-port-enable     = "false"
  }

  lifecycle {
    precondition {
      condition     = startswith(var.zone, "${var.region}-")
      error_message = "zone must be in region (for example ${var.region}-a)."
    }
  }
}
