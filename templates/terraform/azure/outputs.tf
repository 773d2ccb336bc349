output "node_names" {
  description = "Host names of the scale set's VMs"
  value       = data.azurerm_virtual_machine_scale_set.nodes.instances[*].computer_name
}

output "private_ips" {
  description = "Private IPv4 address of each VM"
  value       = data.azurerm_virtual_machine_scale_set.nodes.instances[*].private_ip_address
}

output "instance_ids" {
  description = "Scale set instance ids"
  value       = data.azurerm_virtual_machine_scale_set.nodes.instances[*].instance_id
}

output "scale_set_id" {
  description = "The VM scale set (one InfiniBand partition)"
  value       = azurerm_linux_virtual_machine_scale_set.nodes.id
}

output "shared_storage" {
  description = "The shared filesystem for checkpoints (null: none)"
  value       = local.shared_storage
}

output "head" {
  description = "The head VM (SSH jump host; null when not created): name, addresses, login user"
  value = local.head_enabled ? {
    name       = one(azurerm_linux_virtual_machine.head[*].name)
    private_ip = one(azurerm_linux_virtual_machine.head[*].private_ip_address)
    public_ip  = one(azurerm_public_ip.head[*].ip_address)
    user       = var.admin_username
  } : null
}

output "ansible_inventory" {
  description = "Ansible YAML inventory as a map: gpuprov up writes it to ansible/inventory.yml"
  value = {
    all = {
      vars = {
        ansible_user            = var.admin_username
        ansible_port            = 22
        ansible_ssh_common_args = local.jump_host == null ? "" : "-o ProxyJump=${local.jump_host}"
        shared_storage_mount    = local.shared_storage
      }
      children = {
        gpu_nodes = {
          hosts = { for vm in data.azurerm_virtual_machine_scale_set.nodes.instances : vm.computer_name => { ansible_host = local.jump_host == null ? vm.public_ip_address : vm.private_ip_address, private_ip = vm.private_ip_address } }
        }
      }
    }
  }
}
