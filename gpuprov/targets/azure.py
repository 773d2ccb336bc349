"""Azure: one InfiniBand VM scale set from templates/terraform/azure/, Azure Managed Lustre."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from gpuprov.errors import GpuprovError
from gpuprov.targets.base import Limits, Target, TfvarsKeys, head_connection_problem

if TYPE_CHECKING:
    from gpuprov.plan import Plan

# One scale set with single_placement_group = true is one InfiniBand partition: at most 100 VMs.
SINGLE_PLACEMENT_GROUP_MAX = 100
# the module's scale_set_id output: the subscription, group and name `az vmss` takes
SCALE_SET_ID = re.compile(r"/subscriptions/(?P<sub>[^/]+)/resourceGroups/(?P<group>[^/]+)/providers/"
                          r"Microsoft\.Compute/virtualMachineScaleSets/(?P<name>[^/]+)", re.IGNORECASE)


class Azure(Target):
    name, title = "azure", "Azure"
    boot_disk_gib = 512  # each node's Premium_LRS OS disk (priced in storage_cost.py)
    limits = Limits(
        max_nodes=SINGLE_PLACEMENT_GROUP_MAX,
        why=f"the {SINGLE_PLACEMENT_GROUP_MAX}-VM limit of one InfiniBand scale set (single_placement_group)",
        source="https://learn.microsoft.com/azure/virtual-machine-scale-sets/"
               "virtual-machine-scale-sets-placement-groups (az-hop MaxScaleSetSize)")
    image_ref_keys = ("publisher", "offer", "sku", "version")
    tfvars = TfvarsKeys(instance="vm_size", region="location", shared="shared_storage_tib")

    def connection_problem(self, plan: Plan, value: Any) -> str | None:
        return head_connection_problem(plan, value)

    # An evicted Spot VM (eviction policy Delete) is deleted and the scale set's capacity drops; the
    # next apply restores node_count and the scale set adds a VM under a new name (catalog
    # node_launch.azure): `up` finds the lost ones and runs from terraform plan on; nothing is written.
    replaces_lost_nodes = True

    def node_states_argv(self, s: dict[str, Any], nodes: dict[str, str]) -> list[str] | None:
        match = SCALE_SET_ID.fullmatch(str((s.get("outputs") or {}).get("scale_set_id") or ""))
        if match is None:  # an older bundle's outputs: the scale set cannot be named
            return None
        return ["az", "vmss", "list-instances", "--subscription", match["sub"], "--resource-group", match["group"],
                "--name", match["name"], "--query", "[].[instanceId, provisioningState]", "--output", "json"]

    def lost_nodes(self, nodes: dict[str, str], answer: str) -> list[str]:
        import json

        from gpuprov.catalog import bringup as cat

        try:
            rows = json.loads(answer)
        except ValueError:
            rows = None
        if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) == 2 and isinstance(r[0], str)
                                                 for r in rows):
            raise GpuprovError("az vmss list-instances answered no [[instanceId, provisioningState], ...] list")
        lost_states = set(cat.node_launch(self.name)["lost_states"])
        listed = {i for i, state in rows if state not in lost_states}
        return [name for name, i in nodes.items() if i not in listed]

    def replacement_vars(self, names: list[str], settings: dict[str, Any], earlier: dict[str, Any]) -> dict[str, Any]:
        return {}

    def terraform_inputs(self, plan: Plan) -> dict[str, Any]:
        shared = plan.shared_storage
        return {"vm_size": plan.instance.name, "os_disk_size_gb": self.boot_disk_gib,
                "image_ref": dict(plan.image.ref) if plan.image else {},
                "shared_storage_tib": shared.size_gib // 1024 if shared else 0,
                "shared_storage_sku": shared.options.get("sku", "AMLFS-Durable-Premium-500") if shared
                else "AMLFS-Durable-Premium-500"}


TARGET = Azure()
