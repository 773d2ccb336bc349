"""On-prem: machines the user owns, listed in a hosts file; no Terraform, the inventory is the list."""

from __future__ import annotations

from gpuprov.targets.base import Target


class OnPrem(Target):
    name, title = "onprem", "on-prem"
    provisioner = "inventory"

    def node_cap(self, max_nodes: int, hosts: int | None = None) -> int:
        """At most one node per host listed (no host list: the spec's cap, as a template)."""
        return min(max_nodes, hosts) if hosts else max_nodes


TARGET = OnPrem()
