"""GCP: Compute Engine VMs from templates/terraform/gcp/, GPUDirect (TCPXO / RDMA) NICs, Filestore."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from gpuprov.errors import GpuprovError
from gpuprov.targets.base import Target, TfvarsKeys
from gpuprov.targets.live import LiveCheck, LiveCli, q

if TYPE_CHECKING:
    from gpuprov.plan import Plan

# machine families that accept a compact (COLLOCATED) placement policy
COMPACT_FAMILIES = ("a2-", "a3-", "a4-")


def _nics(plan: Plan) -> tuple[int, int]:
    """(gVNIC data NICs, MRDMA NICs) beyond nic0 for the plan's machine type and fabric."""
    nics, fabric = plan.instance.network_cards, plan.fabric.name  # every NIC, nic0 included
    if fabric == "roce":  # a3-ultragpu/a4: one MRDMA NIC per GPU in the RoCE VPC; the others gVNIC
        rdma = plan.instance.gpus
        gvnic = nics - 1 - rdma
    elif fabric in ("tcpxo", "ethernet") and nics > 1:
        # a3-megagpu (GPUDirect-TCPXO, 1 + 8) and a3-highgpu (TCPX, 1 + 4): one gVNIC VPC per data NIC
        gvnic, rdma = nics - 1, 0
    else:  # single-node plans (fabric "none") and one-NIC machines: nic0 only
        gvnic, rdma = 0, 0
    if gvnic < 0:
        raise GpuprovError(f"{plan.instance.name}: {nics} NICs cannot hold nic0 plus {rdma} MRDMA NICs")
    return gvnic, rdma


def image_family(path: str) -> dict[str, str]:
    """projects/P/global/images/family/F -> image_project P, image_family F."""
    match = re.fullmatch(r"projects/([^/]+)/global/images/family/([^/]+)", path)
    if match is None:
        raise GpuprovError(f"GCP image {path!r} is not projects/P/global/images/family/F")
    return {"image_project": match.group(1), "image_family": match.group(2)}


class Gcp(Target):
    name, title = "gcp", "GCP"
    boot_disk_gib = 500  # each node's boot disk (priced in storage_cost.py)
    image_ref_keys = ("image",)
    tfvars = TfvarsKeys(instance="machine_type", held="reservation_name", shared="shared_storage_gib")
    live = LiveCli(login=("gcloud", "auth", "list", "--filter=status:ACTIVE", "--format=json"),
                   install_fix="install the gcloud CLI: https://cloud.google.com/sdk/docs/install",
                   login_fix="gcloud auth login")

    def live_checks(self, s: dict[str, Any]) -> list[LiveCheck]:
        from gpuprov.targets import gcp_live  # lazy: it reads the catalog, which imports this registry

        return gcp_live.checks(s)

    def quota_family(self, instance: str) -> str:
        return instance.rsplit("-", 1)[0]  # a3-megagpu-8g -> a3-megagpu: the catalog's quota metrics

    def offerings_command(self, instance: str, region: str) -> str:
        return f"gcloud compute machine-types list {q('--filter=name=' + instance)} --format=json"

    def held_id(self, spec: Any, option: str) -> str | None:
        return spec.reservation if option == "reservation" else None

    # A spot VM is deleted when preempted (instance_termination_action DELETE) and google_compute_instance
    # creates a VM it no longer finds again at the next apply, under the same name: `up` only has to
    # find the lost ones and run from terraform plan on; nothing is written for Terraform.
    replaces_lost_nodes = True

    def node_states_argv(self, s: dict[str, Any], nodes: dict[str, str]) -> list[str] | None:
        if s["purchase"] == "flex-start":  # a managed instance group names and replaces its own VMs
            return None
        argv = ["gcloud", "compute", "instances", "list", f"--filter=name=({' '.join(nodes)})",
                "--format=json(name,status)"]
        argv += [f"--project={s['project']}"] if s.get("project") else []
        return argv + ([f"--zones={s['zone']}"] if s.get("zone") else [])

    def lost_nodes(self, nodes: dict[str, str], answer: str) -> list[str]:
        import json

        from gpuprov.catalog import bringup as cat

        try:
            rows = json.loads(answer)
        except ValueError:
            rows = None
        if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("name"), str) for r in rows):
            raise GpuprovError("gcloud compute instances list answered no [{name, status}, ...] list")
        listed = {r["name"] for r in rows if r.get("status") not in cat.node_launch(self.name)["lost_states"]}
        return [name for name in nodes if name not in listed]

    def replacement_vars(self, names: list[str], settings: dict[str, Any], earlier: dict[str, Any]) -> dict[str, Any]:
        return {}

    def held_zone(self, held: str, region: str | None, run: Any) -> str | None:
        from gpuprov.targets import gcp_live

        return gcp_live.held_zone(held, run)

    def terraform_inputs(self, plan: Plan) -> dict[str, Any]:
        from gpuprov.catalog import bringup as cat

        machine = plan.instance.name
        pin, pin_reason = cat.provider_pin("gcp", provisioning_model(plan))
        gvnic, rdma = _nics(plan)
        shared = plan.shared_storage
        return {
            "machine_type": machine,
            "gpu_nic_count": gvnic,
            "rdma_nic_count": rdma,
            "gpu_network_mtu": plan.fabric.mtu or 8896,
            "reservation_name": plan.purchase.held,
            "zone": plan.spec.zone,  # a reservation's zone (given, or looked up at generate)
            "reservation_bound": plan.purchase.reservation_bound,
            "max_run_hours": min(168, plan.purchase.max_run_hours or 168),
            # flex-start's managed instance group takes no placement policy (catalog: flex_start.gcp)
            "compact_placement_supported": machine.startswith(COMPACT_FAMILIES) and (
                plan.purchase.option != "flex-start" or bool(cat.load_flex_start("gcp")["compact_placement"])),
            **image_family(plan.image.ref["image"] if plan.image else ""),
            "secure_boot": plan.image.secure_boot if plan.image else False,
            "shared_storage_tier": shared.options.get("tier", "ZONAL") if shared else "ZONAL",
            # a2 machines take no Hyperdisk (GCP "machine series" disk support table)
            "boot_disk_type": "pd-balanced" if machine.startswith("a2-") else "hyperdisk-balanced",
            "boot_disk_size_gb": self.boot_disk_gib,
            "create_timeout": create_timeout(plan.purchase.option),
            "resize_request_state_command": flex_request_state_command(),
            "google_provider_version": pin,
            "google_provider_reason": pin_reason,
        }

    def fabric_role(self, fabric: str) -> str | None:
        if fabric in ("roce", "tcpxo"):  # GPUDirect-RDMA / TCPXO: Google's own NIC stack
            return "gcp_rdma"
        return super().fabric_role(fabric)


def create_timeout(option: str | None) -> str:
    """Terraform's create timeout per VM: the flex-start queue plus ten minutes to boot; else 20m (the provider's)."""
    from gpuprov.catalog import bringup as cat

    if option != "flex-start":
        return "20m"
    return f"{int(cat.load_flex_start('gcp')['queue_minutes']) + 10}m"


def provisioning_model(plan: Plan) -> str | None:
    """The provisioning model the bundle's VMs ask for, where it is not the provider's default."""
    if plan.purchase.option == "flex-start":
        return "FLEX_START"
    if plan.purchase.option == "reservation" and plan.purchase.reservation_bound:
        return "RESERVATION_BOUND"
    return None


def flex_request_state_command() -> str:
    """The CLI call that reads a MIG resize request's state: the module polls it until the VMs exist."""
    from gpuprov.catalog import bringup as cat

    return str(cat.load_flex_start("gcp")["request_state_command"])


TARGET = Gcp()
