"""Azure: one InfiniBand VM scale set from templates/terraform/azure/, Azure Managed Lustre."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpuprov.targets.base import Limits, Target, TfvarsKeys, head_connection_problem

if TYPE_CHECKING:
    from gpuprov.plan import Plan

# One scale set with single_placement_group = true is one InfiniBand partition: at most 100 VMs.
SINGLE_PLACEMENT_GROUP_MAX = 100


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

    def terraform_inputs(self, plan: Plan) -> dict[str, Any]:
        shared = plan.shared_storage
        return {"vm_size": plan.instance.name, "os_disk_size_gb": self.boot_disk_gib,
                "image_ref": dict(plan.image.ref) if plan.image else {},
                "shared_storage_tib": shared.size_gib // 1024 if shared else 0,
                "shared_storage_sku": shared.options.get("sku", "AMLFS-Durable-Premium-500") if shared
                else "AMLFS-Durable-Premium-500"}


TARGET = Azure()
