output "node_names" {
  description = "Node names (name_prefix-node-NN, in pool order; OCI's display names are generated)"
  value       = local.node_names
}

output "private_ips" {
  description = "Primary private IPv4 address of each node"
  value       = data.oci_core_instance.nodes[*].private_ip
}

output "instance_ids" {
  description = "Instance OCIDs, in pool order"
  value       = data.oci_core_instance.nodes[*].id
}

output "cluster_network_id" {
  description = "The RDMA cluster network"
  value       = oci_core_cluster_network.this.id
}

output "shared_storage" {
  description = "The shared filesystem for checkpoints (null: none)"
  value       = local.shared_storage
}

output "head" {
  description = "The head VM (SSH jump host; null when not created): name, addresses, login user"
  value = local.head_enabled ? {
    name       = one(oci_core_instance.head[*].display_name)
    private_ip = one(oci_core_instance.head[*].private_ip)
    public_ip  = one(oci_core_instance.head[*].public_ip)
    user       = var.ssh_user
  } : null
}

output "ansible_inventory" {
  description = "Ansible YAML inventory as a map: gpuprov up writes it to ansible/inventory.yml"
  value = {
    all = {
      vars = {
        ansible_user            = var.ssh_user
        ansible_port            = 22
        ansible_ssh_common_args = local.jump_host == null ? "" : "-o ProxyJump=${local.jump_host}"
        shared_storage_mount    = local.shared_storage
      }
      children = {
        gpu_nodes = {
          # Keyed by position: pool instances do not get distinct display names of our choosing.
          hosts = { for i, node in data.oci_core_instance.nodes : local.node_names[i] => { ansible_host = local.jump_host == null ? node.public_ip : node.private_ip, private_ip = node.private_ip } }
        }
      }
    }
  }
}
