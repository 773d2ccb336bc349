################################################################################
# Shared storage: OCI File Storage (NFS) for checkpoints and data of multi-node runs
################################################################################
# Mounted at /shared by the shared_storage role; local NVMe RAID0 stays the scratch and cache.
# The mount target joins the node NSG, whose self rules allow NFS.

resource "oci_file_storage_file_system" "shared" {
  #checkov:skip=CKV_OCI_15:File Storage always encrypts at rest with Oracle-managed keys; set kms_key_id for a customer-managed Vault key.
  count = var.shared_storage ? 1 : 0

  kms_key_id          = var.kms_key_id
  availability_domain = var.availability_domain
  compartment_id      = var.compartment_ocid
  display_name        = "${var.name_prefix}-shared"
  freeform_tags       = local.freeform_tags
}

resource "oci_file_storage_mount_target" "shared" {
  count = var.shared_storage ? 1 : 0

  availability_domain = var.availability_domain
  compartment_id      = var.compartment_ocid
  subnet_id           = local.node_subnet_id
  display_name        = "${var.name_prefix}-shared"
  nsg_ids             = [oci_core_network_security_group.nodes.id]
  freeform_tags       = local.freeform_tags
}

resource "oci_file_storage_export" "shared" {
  count = var.shared_storage ? 1 : 0

  export_set_id  = oci_file_storage_mount_target.shared[0].export_set_id
  file_system_id = oci_file_storage_file_system.shared[0].id
  path           = "/shared"
}

locals {
  # What the shared_storage role mounts (null: no shared filesystem in this bundle).
  shared_storage = var.shared_storage ? {
    fstype      = "nfs"
    source      = "${one(oci_file_storage_mount_target.shared[*].ip_address)}:/shared"
    mount_point = var.shared_mount_point
    options     = "rw,hard,noatime,nconnect=16"
  } : null
}
