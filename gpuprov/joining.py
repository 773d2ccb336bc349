"""Nodes that join a cluster an earlier run brought up (a replacement for a lost node): Slurm must
not give them the requeued job before their health check passes.

When `up` writes ansible/inventory.yml over an earlier one, a host whose name is new or whose
address changed, or one `up` found lost and had replaced under its name, is a node that joins.
Their names go into the inventory as `slurm_joining_nodes`: the slurm role drains them on the
controller before their slurmd starts, the health playbook resumes those that pass (`scontrol
update nodename=... state=resume`), and a failing one stays drained with the reason. Once the
health step passes, `up` drops the list from the inventory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

JOINING_VAR = "slurm_joining_nodes"
INVENTORY_LIMIT = 4 << 20


def read_inventory(path: Path) -> dict[str, Any] | None:
    """The inventory an earlier `up` wrote (None: none, or not one `up` could have written)."""
    import os

    from ruamel.yaml import YAML

    from gpuprov.safefile import read_text

    if not os.path.lexists(path):
        return None
    try:
        value = YAML(typ="safe", pure=True).load(read_text(path, limit=INVENTORY_LIMIT, what="inventory"))
    except Exception:  # not a regular bounded file, or not YAML (ruamel's errors share no narrower base)
        return None
    return value if isinstance(value, dict) else None


def hosts_of(inventory: dict[str, Any] | None) -> dict[str, Any]:
    try:
        hosts = inventory["all"]["children"]["gpu_nodes"]["hosts"]  # type: ignore[index]
    except (KeyError, TypeError):
        return {}
    return hosts if isinstance(hosts, dict) else {}


def listed(inventory: dict[str, Any] | None) -> list[str]:
    """The joining nodes an inventory lists."""
    try:
        names = inventory["all"]["vars"][JOINING_VAR]  # type: ignore[index]
    except (KeyError, TypeError):
        return []
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def _address(host: Any) -> Any:
    return (host.get("private_ip") or host.get("ansible_host")) if isinstance(host, dict) else None


def joining_nodes(old: dict[str, Any] | None, new: dict[str, Any]) -> list[str]:
    """The hosts of `new` that join the cluster `old` described: a new name, a changed address, or
    listed as joining in `old` (its health check has not passed yet). [] on a first bring-up."""
    if old is None:
        return []
    before = hosts_of(old)
    still = set(listed(old))
    return sorted(name for name, host in hosts_of(new).items()
                  if name not in before or _address(host) != _address(before[name]) or name in still)


def mark(inventory: dict[str, Any], names: list[str]) -> None:
    """List `names` as joining in the inventory's all.vars (nothing when there are none)."""
    if names:
        inventory["all"].setdefault("vars", {})[JOINING_VAR] = list(names)


def _rewrite(path: Path, inventory: dict[str, Any]) -> None:
    """The inventory back in its file, under the comment line `up` wrote first."""
    import io

    from ruamel.yaml import YAML

    from gpuprov.safefile import read_text, write_atomic

    yaml = YAML(typ="safe", pure=True)
    yaml.default_flow_style = False
    buffer = io.StringIO()
    yaml.dump(inventory, buffer)
    head = read_text(path, limit=INVENTORY_LIMIT, what="inventory").split("\n", 1)[0]
    write_atomic(path, (head + "\n" if head.startswith("#") else "") + buffer.getvalue())


def expect(path: Path, lost: list[str]) -> None:
    """List the lost nodes as joining in the inventory of the cluster they were lost from: a node
    replaced under its name may come back at the same address (a reused private IP), and still joins."""
    inventory = read_inventory(path)
    if inventory is None or not lost or not isinstance(inventory.get("all"), dict):
        return
    mark(inventory, sorted(set(listed(inventory)) | set(lost)))
    _rewrite(path, inventory)


def clear(path: Path) -> list[str]:
    """Drop the joining list from the inventory once the health step passed; the names it held."""
    inventory = read_inventory(path)
    names = listed(inventory)
    if not names or inventory is None:
        return []
    del inventory["all"]["vars"][JOINING_VAR]
    _rewrite(path, inventory)
    return names
