################################################################################
# Shared storage: FSx for Lustre for checkpoints and data of multi-node runs
################################################################################
# Mounted at /shared by the shared_storage role; node-local NVMe RAID0 stays the scratch and cache.
# Its interfaces join the node security group, whose self rule allows all Lustre traffic.

resource "aws_fsx_lustre_file_system" "shared" {
  #checkov:skip=CKV_AWS_178:FSx for Lustre always encrypts at rest (AWS-managed key by default); kms_key_arn switches to a customer-managed key.
  count = var.shared_storage_gib > 0 ? 1 : 0

  storage_capacity            = var.shared_storage_gib
  deployment_type             = var.shared_storage_deployment_type
  per_unit_storage_throughput = var.shared_storage_throughput_per_tib
  data_compression_type       = "LZ4"
  subnet_ids                  = [local.subnet_id]
  security_group_ids          = [aws_security_group.efa.id]
  kms_key_id                  = var.kms_key_arn

  tags = {
    Name = "${var.name_prefix}-shared"
  }
}

locals {
  # What the shared_storage role mounts (null: no shared filesystem in this bundle).
  shared_storage = var.shared_storage_gib > 0 ? {
    fstype      = "lustre"
    client      = "fsx"
    source      = "${one(aws_fsx_lustre_file_system.shared[*].dns_name)}@tcp:/${one(aws_fsx_lustre_file_system.shared[*].mount_name)}"
    mount_point = var.shared_mount_point
    options     = "noatime,flock"
  } : null
}
