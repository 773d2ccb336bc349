output "node_names" {
  description = "Instance display names, in pool order"
  value       = data.oci_core_instance.nodes[*].display_name
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

output "ansible_inventory" {
  description = "Ansible YAML inventory as a map: gpuprov up writes it to ansible/inventory.yml"
  value = {
    all = {
      children = {
        gpu_nodes = {
          hosts = { for node in data.oci_core_instance.nodes : node.display_name => { ansible_host = node.private_ip } }
        }
      }
    }
  }
}
