"""Can Ansible reach the nodes a bundle creates?

`up` asks `connection_problem` before `terraform plan` (nothing is bought for nodes nobody can
reach; each target's rule lives in its module, gpuprov/targets/) and `inventory_problems` on the
inventory Terraform outputs: every host needs an address, a login user and a connection path
(a ProxyJump/ProxyCommand, or a public address).
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any

JUMP_OPTIONS = ("ProxyJump=", "ProxyCommand=")


def connection_problem(plan: Any, given: dict[str, Any]) -> str | None:
    """Why no connection path to the nodes exists with these Terraform values (None: one does)."""
    from gpuprov.targets import get_target

    def value(name: str, default: Any) -> Any:
        """A variable as `terraform plan` sees it: TF_VAR_name, then terraform.tfvars, then the default."""
        if f"TF_VAR_{name}" in os.environ:
            return os.environ[f"TF_VAR_{name}"] or None
        return given.get(name, default)

    return get_target(plan.cluster.cloud).connection_problem(plan, value)


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
