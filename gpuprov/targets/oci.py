"""OCI: a cluster network of bare-metal shapes from templates/terraform/oci/ (RoCE fabric)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpuprov.targets.base import Target, TfvarsKeys, head_connection_problem

if TYPE_CHECKING:
    from gpuprov.plan import Plan


class Oci(Target):
    name, title = "oci", "OCI"
    boot_disk_gib = 512  # each node's boot volume (priced in storage_cost.py)
    tfvars = TfvarsKeys(instance="shape", subnet="subnet_id", shared="shared_storage")

    def connection_problem(self, plan: Plan, value: Any) -> str | None:
        if not (value("bastion_host", None) or value("ssh_cidr", plan.spec.ssh_cidr)) and value("subnet_id", None):
            return ("the nodes go into your subnet_id, where the bundle creates no head: the nodes cannot be "
                    'reached; set bastion_host = "user@host" (a jump host in that VCN) or ssh_cidr (a public subnet)')
        return head_connection_problem(plan, value)

    def terraform_inputs(self, plan: Plan) -> dict[str, Any]:
        return {"shape": plan.instance.name, "boot_volume_size_gb": self.boot_disk_gib,
                "gpu_image": gpu_image(plan.instance.name)}

    def generate_note(self, plan: Plan) -> str | None:
        if plan.infra is None or plan.infra.inputs.get("gpu_image"):
            return None
        return (f"Oracle lists no Ubuntu GPU image for {plan.instance.name}: image_id has no default; set it in "
                "terraform/terraform.tfvars (an Ubuntu 22.04 image OCID for that shape)")


def gpu_image(shape: str) -> dict[str, Any] | None:
    """Oracle's Ubuntu 22.04 GPU image the bundle imports for this shape (catalog bringup.yaml
    images.oci.import): Oracle publishes one download link per image, not per-region OCIDs, and
    lists the shapes each image serves. None: no listed image; the user names image_id."""
    from gpuprov.catalog import bringup as cat  # lazy: the catalog imports the target registry

    fact = cat.image("oci").get("import")
    if not fact or shape not in fact["shapes"]:
        return None
    return {"name": fact["name"], "uri": fact["uri"], "source": fact["source"]}


TARGET = Oci()
