output "node_names" {
  description = "VM names, in node order"
  value       = local.vms[*].name
}

output "private_ips" {
  description = "Primary (nic0) internal IPv4 address of each node (flex-start: null, not read)"
  value       = local.vms[*].ip
}

output "instance_ids" {
  description = "Compute Engine instance ids, in node order (flex-start: null, not read)"
  value       = local.vms[*].id
}

output "placement_policy" {
  description = "Compact placement policy (null when not used)"
  value       = one(google_compute_resource_policy.placement[*].id)
}

output "shared_storage" {
  description = "The shared filesystem for checkpoints (null: none)"
  value       = local.shared_storage
}

output "ansible_inventory" {
  description = "Ansible YAML inventory as a map: gpuprov up writes it to ansible/inventory.yml"
  value = {
    all = {
      vars = {
        ansible_user            = var.ssh_user
        ansible_port            = 22
        ansible_ssh_common_args = "-o ProxyCommand=\"${local.ssh_proxy}\""
        shared_storage_mount    = local.shared_storage
      }
      children = {
        gpu_nodes = {
          # IAP tunnels by VM name; private_ip is the address inside the network (flex-start: null).
          hosts = { for vm in local.vms : vm.name => { ansible_host = vm.name, private_ip = vm.ip } }
        }
      }
    }
  }
}
