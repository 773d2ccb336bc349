"""AWS: EC2 instances from templates/terraform/aws/, EFA fabric, FSx for Lustre."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpuprov.errors import GpuprovError
from gpuprov.targets.base import Target, TfvarsKeys

if TYPE_CHECKING:
    from gpuprov.plan import Plan


class Aws(Target):
    name, title = "aws", "AWS"
    image_ref_keys = ("ssm_parameter",)
    tfvars = TfvarsKeys(instance="instance_type", held="capacity_reservation_id", zone="availability_zone",
                        subnet="subnet_id", shared="shared_storage_gib")
    live_checks = True
    held_flag = "--capacity-reservation-id"

    def held_id(self, spec: Any, option: str) -> str | None:
        return spec.capacity_reservation_id  # one id names an ODCR or a Capacity Block

    def terraform_inputs(self, plan: Plan) -> dict[str, Any]:
        efa = plan.fabric.name == "efa" and plan.instance.efa_interfaces > 0
        if efa and plan.instance.network_cards < 1:
            raise GpuprovError(f"plan says EFA on {plan.instance.name} but no network cards")
        options = plan.shared_storage.options if plan.shared_storage else {}
        return {
            "efa_enabled": efa,
            "network_cards": max(1, plan.instance.network_cards),
            "capacity_reservation_id": plan.purchase.held,
            "placement_group_name": plan.spec.placement_group,
            "ami_ssm_parameter": plan.image.ref["ssm_parameter"] if plan.image else "",
            "root_volume_size_gib": 512,
            "shared_storage_deployment_type": options.get("deployment_type", "PERSISTENT_2"),
            "shared_storage_throughput_per_tib": options.get("throughput_mb_per_tib", 125),
        }


TARGET = Aws()
