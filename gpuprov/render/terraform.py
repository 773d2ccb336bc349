"""Render the Terraform root module for a plan: templates/terraform/<cloud>/ filled with plan values.

Plan values (instance type, node count) and the target's recorded decisions (`plan.infra`, decided
by gpuprov/targets/<cloud>.py when the plan was made: fabric interfaces, disks, image) become
variable defaults in variables.tf and the example tfvars; every other file of the module is static Terraform. Files
ending in `.j2` are Jinja2 templates (the suffix is dropped), the rest are copied as they are.
On-prem plans get no Terraform: the inventory comes from the user's host list.
"""

from __future__ import annotations

import re

from gpuprov.errors import GpuprovError
from gpuprov.plan import SHARED_MOUNT, Plan
from gpuprov.render import RenderedFiles
from gpuprov.render.escape import FILTERS, hcl  # noqa: F401 - hcl: the renderer's filter, re-exported
from gpuprov.render.jinja_env import environment
from gpuprov.resources import templates_dir
from gpuprov.targets import CLOUDS, get_target  # noqa: F401 - CLOUDS: the clouds with templates, re-exported

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



def render_terraform(plan: Plan) -> RenderedFiles:
    """{path relative to the bundle's terraform/: file text}; {} for on-prem plans."""
    cloud = plan.instance.cloud
    if plan.infra is None or plan.provisioning is None:
        raise GpuprovError("the plan records no infrastructure decisions: run `gpuprov plan` again")
    if plan.provisioning.provisioner != "terraform":
        return {}
    get_target(cloud).check_nodes(plan.cluster.nodes)  # a hand-edited plan.json past the target's limit
    source = templates_dir() / "terraform" / cloud
    env = environment(source)
    env.filters.update(FILTERS)
    context = {**_common(plan), **plan.infra.inputs}
    files: RenderedFiles = {}
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        rel = path.relative_to(source).as_posix()
        if rel.endswith(".j2"):
            files[rel.removesuffix(".j2")] = env.get_template(rel).render(**context)
        else:
            files[rel] = path.read_text()
    backend = getattr(plan.spec, "terraform_backend", None)
    if backend is not None:
        files["backend.tf"] = render_backend(backend)
    return files


def render_backend(backend) -> str:
    """terraform/backend.tf from the spec's terraform_backend (a second terraform block is valid HCL)."""
    width = max((len(k) for k in backend.config), default=0)
    lines = [f"  backend {hcl(backend.type)} {{"]
    lines += [f"    {k:<{width}} = {hcl(val)}" for k, val in sorted(backend.config.items())]
    return ("# Generated by gpuprov from the spec's terraform_backend: the state lives there, not in this folder.\n"
            "# Change it in the spec and regenerate; after a change, `terraform init -migrate-state`.\n"
            "terraform {\n" + "\n".join(lines) + "\n  }\n}\n")
