output "node_names" {
  description = "Node names (the Name tag), in node order"
  value       = local.nodes[*].name
}

output "private_ips" {
  description = "Primary private IPv4 address of each node"
  value       = local.nodes[*].private_ip
}

output "instance_ids" {
  description = "EC2 instance ids, in node order"
  value       = local.nodes[*].id
}

output "placement_group" {
  description = "Placement group holding every node (null: none, e.g. under a Capacity Block)"
  value       = local.placement_group
}

output "shared_storage" {
  description = "The shared filesystem for checkpoints (null: none)"
  value       = local.shared_storage
}

output "security_group_id" {
  description = "EFA security group (all traffic within itself)"
  value       = aws_security_group.efa.id
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
          # SSM addresses instances by id; private_ip is kept for NCCL and the rendezvous.
          hosts = { for node in local.nodes : node.name => { ansible_host = node.id, private_ip = node.private_ip } }
        }
      }
    }
  }
}
