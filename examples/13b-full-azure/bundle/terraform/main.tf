# GPU nodes for the gpuprov plan: one Linux VM scale set. single_placement_group = true puts every
# VM on one InfiniBand fabric partition (at most 100 VMs); the proximity placement group keeps the
# front-end network close too. The Ubuntu HPC image ships the InfiniBand stack and NCCL topology files.

provider "azurerm" {
  features {}
}

# Owner and expiry on every resource: who to ask, and when a forgotten cluster may be deleted.
locals {
  tags = merge(var.tags, { for k, v in { owner = var.owner, expires-on = var.expires_on } : k => v if v != null })
}

################################################################################
# Resource group
################################################################################

resource "azurerm_resource_group" "this" {
  name     = var.resource_group_name
  location = var.location
  tags     = local.tags
}

resource "azurerm_proximity_placement_group" "this" {
  name                = "${var.name_prefix}-ppg"
  location            = azurerm_resource_group.this.location
  resource_group_name = azurerm_resource_group.this.name
  allowed_vm_sizes    = [var.vm_size]
  tags                = local.tags
}

################################################################################
# Nodes
################################################################################

resource "azurerm_linux_virtual_machine_scale_set" "nodes" {
  #checkov:skip=CKV_AZURE_97:Encryption at host needs the EncryptionAtHost feature registered on the subscription, or creation fails; managed disks stay encrypted at rest by the platform. Set encryption_at_host = true once it is registered.
  name                 = "${var.name_prefix}-vmss"
  location             = azurerm_resource_group.this.location
  resource_group_name  = azurerm_resource_group.this.name
  sku                  = var.vm_size
  instances            = var.node_count
  computer_name_prefix = "${var.name_prefix}-"

  # One scale set, one placement group: every VM shares one InfiniBand partition.
  single_placement_group       = true
  proximity_placement_group_id = azurerm_proximity_placement_group.this.id
  platform_fault_domain_count  = 1
  overprovision                = false
  upgrade_mode                 = "Manual"

  admin_username                  = var.admin_username
  disable_password_authentication = true
  encryption_at_host_enabled      = var.encryption_at_host

  # Spot VMs are deleted when Azure reclaims them (the run resumes from its checkpoint).
  priority                     = var.purchase_option == "spot" ? "Spot" : "Regular"
  eviction_policy              = var.purchase_option == "spot" ? "Delete" : null
  max_bid_price                = var.purchase_option == "spot" ? -1 : null
  provision_vm_agent           = true
  extension_operations_enabled = true

  admin_ssh_key {
    username   = var.admin_username
    public_key = var.ssh_public_key
  }

  source_image_reference {
    publisher = var.image.publisher
    offer     = var.image.offer
    sku       = var.image.sku
    version   = var.image.version
  }

  os_disk {
    caching              = "ReadWrite"
    storage_account_type = "Premium_LRS"
    disk_size_gb         = var.os_disk_size_gb
  }

  network_interface {
    name                          = "${var.name_prefix}-nic"
    primary                       = true
    enable_accelerated_networking = true

    ip_configuration {
      name      = "internal"
      primary   = true
      subnet_id = azurerm_subnet.nodes.id

      # With ssh_cidr every node gets a public address that only that CIDR may SSH to (the NSG
      # rule in network.tf); without it the nodes stay private, reached through bastion_host.
      dynamic "public_ip_address" {
        for_each = var.ssh_cidr == null ? [] : ["${var.name_prefix}-pip"]
        content {
          name = public_ip_address.value
        }
      }
    }
  }

  boot_diagnostics {}

  tags = local.tags

  depends_on = [azurerm_subnet_nat_gateway_association.nodes]
}

# The scale set's instance list (names and private IPs) for the outputs.
data "azurerm_virtual_machine_scale_set" "nodes" {
  name                = azurerm_linux_virtual_machine_scale_set.nodes.name
  resource_group_name = azurerm_resource_group.this.name
}
