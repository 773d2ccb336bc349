# GPU nodes for the gpuprov plan: one Compute Engine VM per node, bought with the plan's provisioning
# model (standard, spot or a reservation), a NIC per fabric network (network.tf), no external IPs,
# host maintenance stops the VM (GPUs cannot migrate). Flex-start nodes come from one all-or-nothing
# group request instead (flex.tf).

provider "google" {
  project        = var.project_id
  region         = var.region
  zone           = var.zone
  default_labels = local.labels
}

# Owner and expiry on every resource: who to ask, and when a forgotten cluster may be deleted.
locals {
  labels = merge(var.labels, { for k, v in { owner = var.owner, expires-on = var.expires_on } : k => v if v != null })
}

# The image family's current image, read only when no explicit image is given; the first apply
# pins it, so VMs added later boot the same driver as the running ones. Set image to move on.
data "google_compute_image" "family" {
  count = var.image == null ? 1 : 0

  family  = var.image_family
  project = var.image_project
}

resource "terraform_data" "image" {
  input = one(data.google_compute_image.family[*].self_link)

  lifecycle {
    ignore_changes = [input]
  }
}

locals {
  node_names = [for i in range(var.node_count) : format("%s-node-%02d", var.name_prefix, i)]
  image      = var.image != null ? var.image : terraform_data.image.output

  # NIC order matters to the guest: nic0 is the primary gVNIC, then the gVNIC data networks
  # (TCPX/TCPXO, or the second host network on RoCE machines), then one MRDMA NIC per RoCE subnet.
  nics = concat(
    [{ subnetwork = google_compute_subnetwork.primary.id, nic_type = "GVNIC" }],
    [for s in google_compute_subnetwork.gpu : { subnetwork = s.id, nic_type = "GVNIC" }],
    [for s in google_compute_subnetwork.rdma : { subnetwork = s.id, nic_type = "MRDMA" }],
  )

  # The purchase option as provisioning model. a3-ultra/a4 consume a reservation RESERVATION_BOUND.
  reserved_model     = var.reservation_bound ? "RESERVATION_BOUND" : "STANDARD"
  provisioning_model = lookup({ spot = "SPOT", "flex-start" = "FLEX_START", reservation = local.reserved_model }, var.purchase_option, "STANDARD")
  standard_model     = contains(["STANDARD", "RESERVATION_BOUND"], local.provisioning_model)
  # Spot and flex-start VMs are deleted when reclaimed or at the end of their run; Terraform recreates them.
  termination_action = local.standard_model ? null : "DELETE"
  # Flex-start VMs take no reservation; a named reservation is consumed specifically.
  reservation_affinity = var.reservation_name != null ? "SPECIFIC_RESERVATION" : (var.purchase_option == "flex-start" ? "NO_RESERVATION" : null)

  # Compact placement is decided here, not at generate time: a reservation carries its own placement
  # policy and a second one on the VMs clashes with it.
  compact_placement = var.compact_placement_supported && var.node_count > 1 && var.reservation_name == null

  ssh_proxy = "${var.ssh_proxy_command} --project=${var.project_id} --zone=${var.zone}"

  # Flex-start capacity is allotted per request: N separate VMs could start (and bill) while others
  # still queue, so flex-start nodes are one resize request on a managed instance group (flex.tf).
  flex_group = var.purchase_option == "flex-start"

  # The nodes as the outputs read them, whichever way they were created. Flex-start VMs are known by
  # name from their group (flex.tf); their address and id are not read (null).
  flex_vms = local.flex_group ? sort(data.google_compute_instance_group.flex[0].instances) : []
  vms = concat(
    [for vm in google_compute_instance.node : { name = vm.name, ip = vm.network_interface[0].network_ip, id = vm.instance_id }],
    [for link in local.flex_vms : { name = basename(link), ip = null, id = null }],
  )
}

################################################################################
# Placement
################################################################################

# Compact placement keeps the nodes close in the data-centre network (lower latency for NCCL).
# No vm_count: a policy the VMs use would be replaced whenever node_count changes.
resource "google_compute_resource_policy" "placement" {
  count = local.compact_placement ? 1 : 0

  name   = "${var.name_prefix}-compact"
  region = var.region

  group_placement_policy {
    collocation = "COLLOCATED"
  }
}

################################################################################
# Nodes
################################################################################

resource "google_compute_instance" "node" {
  #checkov:skip=CKV_GCP_38:Customer-supplied keys would have to sit in the Terraform state and be resent on every disk operation; boot disks hold only the OS and drivers and keep Google-managed encryption at rest (set kms_key_self_link for CMEK).
  count = local.flex_group ? 0 : var.node_count

  name              = local.node_names[count.index]
  machine_type      = var.machine_type
  zone              = var.zone
  resource_policies = google_compute_resource_policy.placement[*].id
  labels            = local.labels

  boot_disk {
    initialize_params {
      image = local.image
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

  # GPU VMs cannot live-migrate: stop on host maintenance (standard VMs come back afterwards).
  scheduling {
    on_host_maintenance         = "TERMINATE"
    automatic_restart           = local.standard_model
    provisioning_model          = local.provisioning_model
    preemptible                 = local.provisioning_model == "SPOT"
    instance_termination_action = local.termination_action

    dynamic "max_run_duration" {
      for_each = local.provisioning_model == "FLEX_START" ? [var.max_run_hours * 3600] : []
      content {
        seconds = max_run_duration.value
      }
    }
  }

  dynamic "reservation_affinity" {
    for_each = local.reservation_affinity == null ? [] : [local.reservation_affinity]
    content {
      type = reservation_affinity.value

      dynamic "specific_reservation" {
        for_each = var.reservation_name == null ? [] : [var.reservation_name]
        content {
          key    = "compute.googleapis.com/reservation-name"
          values = [specific_reservation.value]
        }
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

  # Flex-start capacity may queue (up to two hours); a create that times out leaves a tainted VM
  # that the next apply replaces, so the create timeout covers the queue.
  timeouts {
    create = var.create_timeout
  }

  lifecycle {
    # Changing image (set on purpose) must not replace running nodes and wipe their local SSD
    # scratch: it applies to VMs created afterwards.
    ignore_changes = [boot_disk[0].initialize_params[0].image]

    precondition {
      condition     = startswith(var.zone, "${var.region}-")
      error_message = "zone must be in region (for example ${var.region}-a)."
    }
    precondition {
      condition     = (var.reservation_name != null) == (var.purchase_option == "reservation")
      error_message = "purchase_option reservation needs reservation_name; the other options take none."
    }
  }
}
