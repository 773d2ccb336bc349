################################################################################
# Shared storage: Azure Managed Lustre for checkpoints and data of multi-node runs
################################################################################
# Mounted at /shared by the shared_storage role (the Ubuntu-HPC image carries the Lustre client);
# local NVMe RAID0 stays the scratch and cache. It sits in its own subnet of the VNet.

resource "azurerm_subnet" "shared" {
  count = var.shared_storage_tib > 0 ? 1 : 0

  name                            = "${var.name_prefix}-shared"
  resource_group_name             = azurerm_resource_group.this.name
  virtual_network_name            = azurerm_virtual_network.this.name
  address_prefixes                = [cidrsubnet(var.vnet_cidr, 8, 2)]
  default_outbound_access_enabled = false
}

# The node NSG's default rules allow all traffic within the VNet (Lustre 988 and 1019-1023 included).
resource "azurerm_subnet_network_security_group_association" "shared" {
  count = var.shared_storage_tib > 0 ? 1 : 0

  subnet_id                 = azurerm_subnet.shared[0].id
  network_security_group_id = azurerm_network_security_group.nodes.id
}

resource "azurerm_managed_lustre_file_system" "shared" {
  count = var.shared_storage_tib > 0 ? 1 : 0

  name                   = "${var.name_prefix}-shared"
  resource_group_name    = azurerm_resource_group.this.name
  location               = azurerm_resource_group.this.location
  sku_name               = var.shared_storage_sku
  storage_capacity_in_tb = var.shared_storage_tib
  subnet_id              = azurerm_subnet.shared[0].id
  zones                  = [var.shared_storage_zone]
  tags                   = local.tags

  maintenance_window {
    day_of_week        = "Sunday"
    time_of_day_in_utc = "02:00"
  }
}

locals {
  # What the shared_storage role mounts (null: no shared filesystem in this bundle).
  shared_storage = var.shared_storage_tib > 0 ? {
    fstype      = "lustre"
    client      = "image"
    source      = "${one(azurerm_managed_lustre_file_system.shared[*].mgs_address)}@tcp:/lustrefs"
    mount_point = var.shared_mount_point
    options     = "noatime,flock"
  } : null
}
