################################################################################
# Head: a small VM with a public address in its own subnet, the SSH jump host to the nodes
################################################################################
# The nodes stay private; Ansible and the operator reach them with ProxyJump through this VM
# (outputs.tf). Only bastion_cidr may SSH to it. Off with create_head = false (nodes with public
# addresses through ssh_cidr, or a jump host of your own through bastion_host).

locals {
  head_enabled = var.create_head && var.bastion_host == null

  # The SSH jump to the nodes: your own bastion_host, else the head; null when neither (public nodes).
  jump_host = var.bastion_host != null ? var.bastion_host : (local.head_enabled ? "${var.admin_username}@${one(azurerm_public_ip.head[*].ip_address)}" : null)
}

resource "azurerm_subnet" "head" {
  count = local.head_enabled ? 1 : 0

  name                            = "${var.name_prefix}-head"
  resource_group_name             = azurerm_resource_group.this.name
  virtual_network_name            = azurerm_virtual_network.this.name
  address_prefixes                = [cidrsubnet(var.vnet_cidr, 8, 0)]
  default_outbound_access_enabled = false
}

resource "azurerm_network_security_group" "head" {
  count = local.head_enabled ? 1 : 0

  name                = "${var.name_prefix}-head-nsg"
  location            = azurerm_resource_group.this.location
  resource_group_name = azurerm_resource_group.this.name
  tags                = local.tags
}

resource "azurerm_network_security_rule" "head_ssh" {
  count = local.head_enabled ? 1 : 0

  name                        = "ssh-from-operator"
  resource_group_name         = azurerm_resource_group.this.name
  network_security_group_name = azurerm_network_security_group.head[0].name
  priority                    = 100
  direction                   = "Inbound"
  access                      = "Allow"
  protocol                    = "Tcp"
  source_address_prefix       = var.bastion_cidr
  source_port_range           = "*"
  destination_address_prefix  = "*"
  destination_port_range      = "22"
  description                 = "SSH to the head from the operator's network"
}

resource "azurerm_subnet_network_security_group_association" "head" {
  count = local.head_enabled ? 1 : 0

  subnet_id                 = azurerm_subnet.head[0].id
  network_security_group_id = azurerm_network_security_group.head[0].id
}

resource "azurerm_public_ip" "head" {
  count = local.head_enabled ? 1 : 0

  name                = "${var.name_prefix}-head-ip"
  location            = azurerm_resource_group.this.location
  resource_group_name = azurerm_resource_group.this.name
  allocation_method   = "Static"
  sku                 = "Standard"
  tags                = local.tags
}

resource "azurerm_network_interface" "head" {
  #checkov:skip=CKV_AZURE_119:The head is the jump host: its public address is the one way in, and its NSG admits SSH from bastion_cidr only.
  count = local.head_enabled ? 1 : 0

  name                = "${var.name_prefix}-head-nic"
  location            = azurerm_resource_group.this.location
  resource_group_name = azurerm_resource_group.this.name
  tags                = local.tags

  ip_configuration {
    name                          = "internal"
    subnet_id                     = azurerm_subnet.head[0].id
    private_ip_address_allocation = "Dynamic"
    public_ip_address_id          = azurerm_public_ip.head[0].id
  }
}

resource "azurerm_linux_virtual_machine" "head" {
  #checkov:skip=CKV_AZURE_50:The Azure VM agent stays on (extension_operations_enabled) so that the platform can reset SSH keys on the jump host; no extension is installed by this module.
  #checkov:skip=CKV_AZURE_97:Encryption at host needs the EncryptionAtHost feature registered on the subscription; the head's OS disk holds no data and stays platform-encrypted.
  count = local.head_enabled ? 1 : 0

  name                            = "${var.name_prefix}-head"
  location                        = azurerm_resource_group.this.location
  resource_group_name             = azurerm_resource_group.this.name
  size                            = var.head_size
  admin_username                  = var.admin_username
  disable_password_authentication = true
  network_interface_ids           = [azurerm_network_interface.head[0].id]
  provision_vm_agent              = true
  allow_extension_operations      = true
  tags                            = local.tags

  admin_ssh_key {
    username   = var.admin_username
    public_key = var.ssh_public_key
  }

  os_disk {
    caching              = "ReadWrite"
    storage_account_type = "StandardSSD_LRS"
  }

  source_image_reference {
    publisher = var.head_image.publisher
    offer     = var.head_image.offer
    sku       = var.head_image.sku
    version   = var.head_image.version
  }

  boot_diagnostics {}

  lifecycle {
    precondition {
      condition     = var.bastion_cidr != null
      error_message = "The head (jump host) needs bastion_cidr: the CIDR allowed to SSH to it, e.g. your address/32. Or set create_head = false with ssh_cidr (public nodes) or bastion_host (your own jump host)."
    }
  }
}
