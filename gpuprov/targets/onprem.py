"""On-prem: machines the user owns, listed in a hosts file; no Terraform, the inventory is the list."""

from __future__ import annotations

from typing import Any

from gpuprov.targets.base import Target

PROBE = "unknown: run `gpuprov hosts probe HOSTS --write` (or give fabric: and nic_gbps: per host)"


class OnPrem(Target):
    name, title = "onprem", "on-prem"
    provisioner = "inventory"
    # the site's machines: a role that needs a reboot stops and says so; the owner reboots
    reboot_allowed = False

    def node_cap(self, max_nodes: int, hosts: int | None = None) -> int:
        """At most one node per host listed (no host list: the spec's cap, as a template)."""
        return min(max_nodes, hosts) if hosts else max_nodes

    def plan_fabric(self, fabric: Any, unknown: tuple[str, ...] | list[str], nodes: int) -> Any:
        """A fabric the hosts file does not state is not configured on a guess: no subnet manager
        (opensm on a site whose switches run one, or on Ethernet, is harm), no RDMA role, no NCCL
        transport demanded by the health check. The time model keeps the assumed fabric; it says so."""
        if nodes < 2 or "fabric" not in unknown:
            return fabric
        probe = f"{PROBE}; the time model assumed {fabric.name} at {fabric.gbps_per_gpu:g} Gb/s per GPU"
        return fabric.model_copy(update={"subnet_manager": "none", "nccl_net": None, "hcas": [], "probe": probe})


TARGET = OnPrem()
