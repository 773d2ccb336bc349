output "node_names" {
  description = "Node names (the Name tag), in node order"
  value       = aws_instance.node[*].tags["Name"]
}

output "private_ips" {
  description = "Primary private IPv4 address of each node"
  value       = aws_instance.node[*].private_ip
}

output "instance_ids" {
  description = "EC2 instance ids, in node order"
  value       = aws_instance.node[*].id
}

output "placement_group" {
  description = "Cluster placement group holding every node"
  value       = aws_placement_group.cluster.name
}

output "security_group_id" {
  description = "EFA security group (all traffic within itself)"
  value       = aws_security_group.efa.id
}

output "ansible_inventory" {
  description = "Ansible YAML inventory as a map: gpuprov up writes it to ansible/inventory.yml"
  value = {
    all = {
      children = {
        gpu_nodes = {
          hosts = { for node in aws_instance.node : node.tags["Name"] => { ansible_host = node.private_ip } }
        }
      }
    }
  }
}
