"""Render the Terraform root module for a plan: templates/terraform/<cloud>/ filled with plan values.

Plan-decided values (instance type, node count, fabric interfaces) become variable defaults in
variables.tf and the example tfvars; every other file of the module is static Terraform. Files
ending in `.j2` are Jinja2 templates (the suffix is dropped), the rest are copied as they are.
On-prem plans get no Terraform: the inventory comes from the user's host list.
"""

from __future__ import annotations

import re

from gpuprov.errors import GpuprovError
from gpuprov.plan import Plan
from gpuprov.render import RenderedFiles
from gpuprov.render.escape import FILTERS, hcl  # noqa: F401 - hcl: the renderer's filter, re-exported
from gpuprov.resources import templates_dir

CLOUDS = ("aws", "gcp", "azure", "oci")

# Azure: one scale set with single_placement_group = true is one InfiniBand partition, max 100 VMs
# (az-hop MaxScaleSetSize; Azure docs "placement groups").
AZURE_SINGLE_PLACEMENT_GROUP_MAX = 100

# GCP machine families that accept a compact (COLLOCATED) placement policy.
GCP_COMPACT_FAMILIES = ("a2-", "a3-", "a4-")


def _slug(text: str, limit: int) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return slug[:limit].rstrip("-") or "model"


def _common(plan: Plan) -> dict:
    model = _slug(plan.model.name.rsplit("/", 1)[-1].removesuffix(".json"), 16)
    return {
        "plan_summary": (f"{plan.model.display_name}, {plan.task}, {plan.cluster.nodes} x "
                         f"{plan.instance.name}, {plan.cluster.total_gpus} GPUs, fabric {plan.fabric.name}"),
        "name_prefix": _slug(f"gpuprov-{model}", 24),
        "node_count": plan.cluster.nodes,
        "gpus_per_node": plan.cluster.gpus_per_node,
        "instance_type": plan.instance.name,
        "region": plan.instance.region or plan.cluster.region,
        "ssh_cidr": plan.spec.ssh_cidr,
        "tags": {"managed-by": "gpuprov", "gpuprov-model": model},
    }


def _aws(plan: Plan) -> dict:
    efa = plan.fabric.name == "efa" and plan.instance.efa_interfaces > 0
    if efa and plan.instance.network_cards < 1:
        raise GpuprovError(f"plan says EFA on {plan.instance.name} but no network cards")
    return {
        "efa_enabled": efa,
        "network_cards": max(1, plan.instance.network_cards),
        "capacity_reservation_id": plan.spec.capacity_reservation_id,
        "ami_ssm_parameter": "/aws/service/canonical/ubuntu/server/22.04/stable/current/amd64/hvm/ebs-gp3/ami-id",
        "root_volume_size_gib": 512,
    }


def _gcp(plan: Plan) -> dict:
    machine = plan.instance.name
    nics = plan.instance.network_cards  # every NIC of the machine type, nic0 included
    fabric = plan.fabric.name
    if fabric == "roce":
        # a3-ultragpu/a4: one MRDMA NIC per GPU in the RoCE VPC; the other NICs are gVNIC.
        rdma = plan.instance.gpus
        gvnic = nics - 1 - rdma
    elif fabric in ("tcpxo", "ethernet") and nics > 1:
        # a3-megagpu (GPUDirect-TCPXO, 1 + 8) and a3-highgpu (TCPX, 1 + 4): one gVNIC VPC per data NIC.
        gvnic, rdma = nics - 1, 0
    else:  # single-node plans (fabric "none") and one-NIC machines: nic0 only
        gvnic, rdma = 0, 0
    if gvnic < 0:
        raise GpuprovError(f"{machine}: {nics} NICs cannot hold nic0 plus {rdma} MRDMA NICs")
    return {
        "machine_type": machine,
        "gpu_nic_count": gvnic,
        "rdma_nic_count": rdma,
        "gpu_network_mtu": plan.fabric.mtu or 8896,
        "reservation_name": plan.spec.reservation,
        # A named reservation carries its own placement policy; a second one on the VMs would clash.
        "compact_placement": (plan.cluster.nodes > 1 and machine.startswith(GCP_COMPACT_FAMILIES)
                              and plan.spec.reservation is None),
        "boot_disk_type": "pd-balanced" if machine.startswith("a2-") else "hyperdisk-balanced",
        "boot_disk_size_gb": 500,
    }


def _azure(plan: Plan) -> dict:
    if plan.cluster.nodes > AZURE_SINGLE_PLACEMENT_GROUP_MAX:
        raise GpuprovError(
            f"Azure: {plan.cluster.nodes} nodes exceed the {AZURE_SINGLE_PLACEMENT_GROUP_MAX}-VM limit of one "
            "InfiniBand scale set (single_placement_group); plan at most 100 nodes")
    return {"vm_size": plan.instance.name, "os_disk_size_gb": 512}


def _oci(plan: Plan) -> dict:
    if plan.spec.ssh_cidr:  # the module launches into the user's subnet: its security list decides SSH
        raise GpuprovError("--ssh-cidr has no effect on OCI (the nodes join your subnet_id); "
                           "open SSH in that subnet's security list instead")
    return {"shape": plan.instance.name, "boot_volume_size_gb": 512}


_PER_CLOUD = {"aws": _aws, "gcp": _gcp, "azure": _azure, "oci": _oci}


def render_terraform(plan: Plan) -> RenderedFiles:
    """{path relative to the bundle's terraform/: file text}; {} for on-prem plans."""
    cloud = plan.instance.cloud
    if cloud == "onprem":
        return {}
    if cloud not in _PER_CLOUD:
        raise GpuprovError(f"no Terraform templates for cloud {cloud!r}")
    import jinja2  # lazy: `gpuprov plan` must start fast

    source = templates_dir() / "terraform" / cloud
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(source)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
                             autoescape=False)
    env.filters.update(FILTERS)
    context = {**_common(plan), **_PER_CLOUD[cloud](plan)}
    files: RenderedFiles = {}
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        rel = path.relative_to(source).as_posix()
        if rel.endswith(".j2"):
            files[rel.removesuffix(".j2")] = env.get_template(rel).render(**context)
        else:
            files[rel] = path.read_text()
    return files
