"""Can Ansible reach the nodes a bundle creates? One place for each cloud's connection rules.

`up` asks `connection_problem` before `terraform plan` (nothing is bought for nodes nobody can
reach) and `inventory_problems` on the inventory Terraform outputs. The per-cloud rules mirror the
modules: AWS reaches nodes through SSM (the bundle's VPC has a NAT route; a given subnet's routes
are checked live by `validate`), GCP through IAP, Azure and OCI through the head (a jump host VM
that needs `bastion_cidr`), a jump host of the user's own (`bastion_host`) or public node
addresses (`ssh_cidr`).
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any

JUMP_OPTIONS = ("ProxyJump=", "ProxyCommand=")

HOW = ('set bastion_cidr = "<your address>/32" in terraform/terraform.tfvars (the CIDR allowed to SSH to '
       'the head, the jump host the bundle creates), or bastion_host = "user@host" (a jump host of your '
       'own in the network), or ssh_cidr (public node addresses, SSH from that CIDR)')


def _value(given: dict[str, Any], name: str, default: Any) -> Any:
    """A variable's value as `terraform plan` will see it: TF_VAR_name, terraform.tfvars, the default."""
    if f"TF_VAR_{name}" in os.environ:
        return os.environ[f"TF_VAR_{name}"] or None
    return given.get(name, default)


def connection_problem(plan: Any, given: dict[str, Any]) -> str | None:
    """Why no connection path to the nodes exists with these Terraform values (None: one does)."""
    cloud = plan.cluster.cloud
    if cloud not in ("azure", "oci"):
        return None  # aws: SSM, gcp: IAP, on-prem: the hosts file
    head_default = plan.access is not None and plan.access.method == "bastion"
    if _value(given, "bastion_host", None) or _value(given, "ssh_cidr", plan.spec.ssh_cidr):
        return None
    create_head = _value(given, "create_head", head_default) not in (False, "false")
    if cloud == "oci" and _value(given, "subnet_id", None):
        return ("the nodes go into your subnet_id, where the bundle creates no head: the nodes cannot be reached; "
                'set bastion_host = "user@host" (a jump host in that VCN) or ssh_cidr (a public subnet)')
    if not create_head:
        return f"create_head is false and the nodes have no public address: the nodes cannot be reached; {HOW}"
    if not _value(given, "bastion_cidr", None):
        return f"the head (jump host) admits SSH from bastion_cidr, which is not set; {HOW}"
    return None


def _is_public(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_global
    except ValueError:
        return False  # an instance id or a name: reachable only through a proxy


def inventory_problems(inventory: dict) -> list[str]:
    """Hosts of a Terraform-output inventory that have no connection path (a proxy or a public address)."""
    group_vars = inventory.get("all", {}).get("vars") or {}
    hosts = inventory.get("all", {}).get("children", {}).get("gpu_nodes", {}).get("hosts") or {}
    problems = []
    for name, host in sorted(hosts.items()):
        merged = {**group_vars, **(host or {})}
        address = merged.get("ansible_host")
        proxied = any(option in (merged.get("ansible_ssh_common_args") or "") for option in JUMP_OPTIONS)
        if not address:
            problems.append(f"{name}: no address (ansible_host is empty)")
        elif not proxied and not _is_public(str(address)):
            problems.append(f"{name}: {address} is private and no ProxyJump/ProxyCommand leads to it")
        if not merged.get("ansible_user"):
            problems.append(f"{name}: no login user (ansible_user)")
    return problems
