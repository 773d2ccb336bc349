"""Render the Terraform root module for a plan: templates/terraform/<cloud>/ filled with plan values.

Plan-decided values (instance type, node count, fabric interfaces) become variable defaults in
variables.tf and the example tfvars; every other file of the module is static Terraform. Files
ending in `.j2` are Jinja2 templates (the suffix is dropped), the rest are copied as they are.
On-prem plans get no Terraform: the inventory comes from the user's host list.
"""

from __future__ import annotations

import re

from gpuprov.errors import GpuprovError
from gpuprov.plan import SHARED_MOUNT, Plan
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


def _name_prefix(model: str, bundle_id: str) -> str:
    """gpuprov-<model>-<bundle id>, at most 24 characters: two bundles get different resource names."""
    if not bundle_id:
        return _slug(f"gpuprov-{model}", 24)
    return f"{_slug(f'gpuprov-{model}', 24 - len(bundle_id) - 1)}-{bundle_id}"


def _shared(plan: Plan) -> dict:
    shared = plan.shared_storage
    return {"shared_storage_gib": shared.size_gib if shared else 0,
            "shared_mount_point": shared.mount_point if shared else SHARED_MOUNT,
            "shared_options": dict(shared.options) if shared else {}, "shared_storage_on": shared is not None}


def _common(plan: Plan) -> dict:
    model = _slug(plan.model.name.rsplit("/", 1)[-1].removesuffix(".json"), 16)
    if plan.image is None or plan.access is None:
        raise GpuprovError("the plan names no image or access method for the nodes: regenerate the plan")
    tags = {"managed-by": "gpuprov", "gpuprov-model": model}
    if plan.bundle_id:
        tags["gpuprov-bundle"] = plan.bundle_id
    return {
        "plan_summary": (f"{plan.model.display_name}, {plan.task}, {plan.cluster.nodes} x "
                         f"{plan.instance.name}, {plan.cluster.total_gpus} GPUs, fabric {plan.fabric.name}, "
                         f"{plan.purchase.option}"),
        "name_prefix": _name_prefix(model, plan.bundle_id),
        "purchase_option": plan.purchase.option,
        "image_name": plan.image.name,
        "ssh_user": plan.access.user,
        "ssh_proxy_command": plan.access.proxy,
        **_shared(plan),
        "node_count": plan.cluster.nodes,
        "gpus_per_node": plan.cluster.gpus_per_node,
        "instance_type": plan.instance.name,
        "region": plan.instance.region or plan.cluster.region,
        "ssh_cidr": plan.spec.ssh_cidr,
        "tags": tags,
        **_head(plan.access),
    }


def _head(access) -> dict:
    """The jump host VM (azure, oci): created by default while the plan's access method is bastion."""
    head = access.head
    if head is None:
        return {"head_enabled": False}
    return {"head_enabled": access.method == "bastion", "head_size": head.size,
            "head_price": f"${head.price_per_hour_usd:,.4f}/h, {head.source}", "head_image": dict(head.image)}


def _aws(plan: Plan) -> dict:
    efa = plan.fabric.name == "efa" and plan.instance.efa_interfaces > 0
    if efa and plan.instance.network_cards < 1:
        raise GpuprovError(f"plan says EFA on {plan.instance.name} but no network cards")
    return {
        "efa_enabled": efa,
        "network_cards": max(1, plan.instance.network_cards),
        "capacity_reservation_id": plan.purchase.held,
        "placement_group_name": plan.spec.placement_group,
        "ami_ssm_parameter": plan.image.ref["ssm_parameter"],
        "root_volume_size_gib": 512,
        "shared_storage_deployment_type": plan.shared_storage.options.get("deployment_type", "PERSISTENT_2")
        if plan.shared_storage else "PERSISTENT_2",
        "shared_storage_throughput_per_tib": plan.shared_storage.options.get("throughput_mb_per_tib", 125)
        if plan.shared_storage else 125,
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
        "reservation_name": plan.purchase.held,
        "reservation_bound": plan.purchase.reservation_bound,
        "max_run_hours": min(168, plan.purchase.max_run_hours or 168),
        "compact_placement_supported": machine.startswith(GCP_COMPACT_FAMILIES),
        **_gcp_image(plan.image.ref["image"]),
        "secure_boot": plan.image.secure_boot,
        "shared_storage_tier": plan.shared_storage.options.get("tier", "ZONAL") if plan.shared_storage else "ZONAL",
        "boot_disk_type": "pd-balanced" if machine.startswith("a2-") else "hyperdisk-balanced",
        "boot_disk_size_gb": 500,
    }


def _gcp_image(path: str) -> dict:
    """projects/P/global/images/family/F -> image_project P, image_family F."""
    match = re.fullmatch(r"projects/([^/]+)/global/images/family/([^/]+)", path)
    if match is None:
        raise GpuprovError(f"GCP image {path!r} is not projects/P/global/images/family/F")
    return {"image_project": match.group(1), "image_family": match.group(2)}


def _azure(plan: Plan) -> dict:
    if plan.cluster.nodes > AZURE_SINGLE_PLACEMENT_GROUP_MAX:
        raise GpuprovError(
            f"Azure: {plan.cluster.nodes} nodes exceed the {AZURE_SINGLE_PLACEMENT_GROUP_MAX}-VM limit of one "
            "InfiniBand scale set (single_placement_group); plan at most 100 nodes")
    shared = plan.shared_storage
    return {"vm_size": plan.instance.name, "os_disk_size_gb": 512, "image_ref": dict(plan.image.ref),
            "shared_storage_tib": shared.size_gib // 1024 if shared else 0,
            "shared_storage_sku": shared.options.get("sku", "AMLFS-Durable-Premium-500") if shared
            else "AMLFS-Durable-Premium-500"}


def _oci(plan: Plan) -> dict:
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
