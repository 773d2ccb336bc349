# Flex-start (Dynamic Workload Scheduler) nodes: one instance template, a managed instance group
# created empty, and one resize request for all nodes. The request is all-or-nothing: every VM
# starts together once the capacity exists, or none does (no VM bills while others queue).
# Resize requests are the managed-instance-group form of flex-start
# (https://cloud.google.com/compute/docs/instance-groups/about-resize-requests-mig).

resource "google_compute_instance_template" "flex" {
  count = local.flex_group ? 1 : 0

  name_prefix       = "${var.name_prefix}-flex-"
  machine_type      = var.machine_type
  labels            = local.labels
  resource_policies = google_compute_resource_policy.placement[*].name

  disk {
    boot         = true
    auto_delete  = true
    source_image = local.image
    disk_size_gb = var.boot_disk_size_gb
    disk_type    = var.boot_disk_type

    dynamic "disk_encryption_key" {
      for_each = var.kms_key_self_link == null ? [] : [var.kms_key_self_link]
      content {
        kms_key_self_link = disk_encryption_key.value
      }
    }
  }

  dynamic "network_interface" {
    for_each = local.nics
    content {
      subnetwork = network_interface.value.subnetwork
      nic_type   = network_interface.value.nic_type
    }
  }

  # The VMs are deleted at the end of their run (max_run_hours) and are never restarted elsewhere.
  scheduling {
    on_host_maintenance         = "TERMINATE"
    automatic_restart           = false
    provisioning_model          = "FLEX_START"
    instance_termination_action = "DELETE"

    max_run_duration {
      seconds = var.max_run_hours * 3600
    }
  }

  # Flex-start takes no reservation.
  reservation_affinity {
    type = "NO_RESERVATION"
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

  metadata = {
    enable-oslogin         = "TRUE"
    block-project-ssh-keys = "true"
    serial-port-enable     = "false"
  }

  lifecycle {
    # The group refers to the template: a new one is made before the old one goes.
    create_before_destroy = true

    precondition {
      condition     = startswith(var.zone, "${var.region}-")
      error_message = "zone must be in region (for example ${var.region}-a)."
    }
    precondition {
      condition     = var.reservation_name == null || !local.flex_group
      error_message = "flex-start takes no reservation: set reservation_name = null or purchase_option = \"reservation\"."
    }
  }
}

resource "google_compute_instance_group_manager" "flex" {
  count = local.flex_group ? 1 : 0

  # node_count in the name: a new size is a new group and a new all-or-nothing request (flex-start
  # VMs cannot be added one by one), not a second request on top of the running nodes.
  name               = "${var.name_prefix}-flex-${var.node_count}"
  zone               = var.zone
  base_instance_name = "${var.name_prefix}-node"
  # Created empty: only the resize request adds VMs, all at once.
  target_size        = 0
  wait_for_instances = false

  version {
    instance_template = google_compute_instance_template.flex[0].self_link
  }

  # A flex-start VM that fails is not recreated on other capacity behind the request's back.
  instance_lifecycle_policy {
    default_action_on_failure = "DO_NOTHING"
  }

  # A changed template applies to VMs created later; running nodes (and their local SSD) stay.
  update_policy {
    type           = "OPPORTUNISTIC"
    minimal_action = "REFRESH"
  }

  lifecycle {
    # The resize request raises target_size; Terraform must not set it back to 0.
    ignore_changes = [target_size]
  }
}

# One request for every node. Changing node_count replaces it (a new all-or-nothing request); a
# request that FAILED or timed out in the queue is asked again with
# `terraform apply -replace='google_compute_resize_request.flex[0]'`.
resource "google_compute_resize_request" "flex" {
  count = local.flex_group ? 1 : 0

  name                   = "${var.name_prefix}-request-${var.node_count}"
  zone                   = var.zone
  instance_group_manager = google_compute_instance_group_manager.flex[0].name
  resize_by              = var.node_count
  description            = "gpuprov: ${var.node_count} x ${var.machine_type}, all or nothing"

  timeouts {
    create = var.create_timeout
  }
}

# The provider's create returns once the request is queued; the inventory needs the VMs, so wait
# until the request SUCCEEDED (or stop on FAILED/CANCELLED, or after create_timeout's queue).
resource "terraform_data" "flex_ready" {
  count = local.flex_group ? 1 : 0

  triggers_replace = google_compute_resize_request.flex[0].id

  provisioner "local-exec" {
    interpreter = ["/bin/bash", "-c"]
    command     = <<-EOT
      set -u
      deadline=$(( $(date +%s) + $WAIT_MINUTES * 60 ))
      while :; do
        state=$($STATE_COMMAND "$REQUEST" --instance-group="$GROUP" --zone="$ZONE" --project="$PROJECT" --format='value(state)') || exit 1
        case "$state" in
          SUCCEEDED) exit 0 ;;
          FAILED|CANCELLED) echo "resize request $REQUEST is $state: ask again with terraform apply -replace='google_compute_resize_request.flex[0]'" >&2; exit 1 ;;
        esac
        if [ "$(date +%s)" -ge "$deadline" ]; then
          echo "resize request $REQUEST still $state after $WAIT_MINUTES minutes (it stays queued; run terraform apply again to keep waiting)" >&2
          exit 1
        fi
        sleep 30
      done
    EOT
    environment = {
      STATE_COMMAND = var.resize_request_state_command
      REQUEST       = google_compute_resize_request.flex[0].name
      GROUP         = google_compute_instance_group_manager.flex[0].name
      ZONE          = var.zone
      PROJECT       = var.project_id
      WAIT_MINUTES  = trimsuffix(var.create_timeout, "m")
    }
  }
}

# The group's VMs, listed once the request has succeeded (all node_count of them exist then). Only
# the group is read, not each VM: once max_run_hours have passed the VMs are deleted, and a read of
# a deleted VM would fail every later plan, `terraform destroy` included.
data "google_compute_instance_group" "flex" {
  count = local.flex_group ? 1 : 0

  self_link = google_compute_instance_group_manager.flex[0].instance_group

  depends_on = [terraform_data.flex_ready]
}
