"""OCI: a cluster network of bare-metal shapes from templates/terraform/oci/ (RoCE fabric)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpuprov.targets.base import Target, TfvarsKeys

if TYPE_CHECKING:
    from gpuprov.plan import Plan


class Oci(Target):
    name, title = "oci", "OCI"
    tfvars = TfvarsKeys(instance="shape")

    def terraform_inputs(self, plan: Plan) -> dict[str, Any]:
        return {"shape": plan.instance.name, "boot_volume_size_gb": 512}


TARGET = Oci()
