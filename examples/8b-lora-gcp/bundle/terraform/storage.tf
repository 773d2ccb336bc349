################################################################################
# Shared storage: a Filestore instance for checkpoints and data of multi-node runs
################################################################################
# Mounted at /shared (NFS) by the shared_storage role; local SSD RAID0 stays the scratch and cache.

resource "google_filestore_instance" "shared" {
  count = var.shared_storage_gib > 0 ? 1 : 0

  name     = "${var.name_prefix}-shared"
  location = var.zone
  tier     = var.shared_storage_tier
  labels   = local.labels

  file_shares {
    name        = "shared"
    capacity_gb = var.shared_storage_gib
  }

  networks {
    network = google_compute_network.primary.name
    modes   = ["MODE_IPV4"]
  }
}

locals {
  # What the shared_storage role mounts (null: no shared filesystem in this bundle).
  shared_storage = var.shared_storage_gib > 0 ? {
    fstype      = "nfs"
    source      = "${one(google_filestore_instance.shared[*].networks[0].ip_addresses[0])}:/shared"
    mount_point = var.shared_mount_point
    options     = "rw,hard,noatime,nconnect=16"
  } : null
}
