"""The bring-up part of a Plan: purchase option, image, access, shared storage, bundle id.

The planner calls `priced_pool` before its search (each instance type carries the price of the
cheapest purchase option the user allows and can use; types nothing allowed can buy drop out) and
`bringup_fields` / `purchase_alternatives` / `purchase_notes` when it builds the Plan.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from gpuprov.catalog import bringup as cat
from gpuprov.errors import GpuprovError
from gpuprov.host import rules
from gpuprov.plan import Access, Alternative, Head, Image, Purchase, SharedStorage
from gpuprov.targets import get_target


def priced_pool(pool: list[Any], spec: Any) -> tuple[list[Any], list[Any]]:
    """(instances priced at their best usable offer, cloud instances no allowed option can buy)."""
    kept, unbuyable = [], []
    for inst in pool:
        if inst.onprem:
            kept.append(inst)
            continue
        offer = cat.best_offer(spec, inst)
        if offer is None:
            unbuyable.append(inst)
            continue
        kept.append(dataclasses.replace(inst, purchase=offer.option, price_per_hour_usd=offer.price_per_hour_usd,
                                        price_date=offer.price_date, price_source=offer.price_source))
    return kept, unbuyable


def unbuyable_hint(spec: Any, unbuyable: list[Any]) -> str:
    """Why some instance types were not searched, and how to allow them (empty when none)."""
    scope = [i for i in unbuyable if (spec.cloud in ("any", i.cloud))
             and (not spec.gpus or i.gpu.lower() in {g.lower() for g in spec.gpus})]
    if not scope:
        return ""
    named = ", ".join(f"{i.name} ({'/'.join(cat.offered_options(i))})" for i in scope[:4])
    return (f"; not searched, no allowed purchase option buys them: {named}: allow one with --purchase "
            f"(allowed now: {','.join(cat.allowed_options(spec))}), a reservation needs --reservation / "
            f"--capacity-reservation-id")


# What names a deployment: changing the token count, the deadline or the batch must not rename
# (and so replace) running resources; a second bundle for the same model, task and place sets
# name_prefix in terraform.tfvars.
IDENTITY_FIELDS = {"model", "task", "cloud", "region", "gpus"}


def bundle_id(spec: Any) -> str:
    """Six hex digits from the spec fields that name the deployment (only those the user set, so a
    release that adds a spec field renames nothing)."""
    identity = spec.model_dump_json(include=IDENTITY_FIELDS, exclude_defaults=True)
    return hashlib.sha256(identity.encode()).hexdigest()[:6]


def _purchase(spec: Any, inst: Any) -> Any:
    if inst.onprem:
        return Purchase()
    offer = next(o for o in cat.offers(inst) if o.option == inst.purchase)
    return Purchase(option=offer.option, price_per_hour_usd=inst.price_per_hour_usd, preemptible=offer.preemptible,
                    reservation_bound=offer.reservation_bound, max_run_hours=offer.max_run_hours,
                    held=cat.held(spec, offer, inst.cloud), risk=offer.risk, source=offer.source)


def _image(cloud: str) -> Any:
    entry = cat.image(cloud)
    ref_keys = get_target(cloud).image_ref_keys
    return Image(name=entry["name"], ref={k: str(entry[k]) for k in ref_keys}, user=entry["user"],
                 secure_boot=bool(entry["secure_boot"]), driver_preinstalled=bool(entry["driver_preinstalled"]),
                 source=entry["source"])


def _access(cloud: str, image_user: str | None, spec: Any) -> Any:
    entry = cat.access(cloud)
    user = image_user if cloud != "onprem" else None  # on-prem: per host, from the hosts file
    head = None
    if entry.get("head"):  # the jump host VM's facts; created only while the method is bastion
        h = entry["head"]
        head = Head(size=h["size"], price_per_hour_usd=float(h["price_per_hour_usd"]),
                    image={k: str(v) for k, v in h["image"].items()}, source=h["source"])
    if entry["method"] == "bastion" and spec.ssh_cidr:
        # the alternative to a bastion: public node addresses, SSH from that CIDR only
        return Access(method="ssh", user=user, head=head, source=f"public node addresses, SSH from {spec.ssh_cidr} only")
    source = entry["source"]
    if entry.get("no_public_address") and spec.ssh_cidr:  # nothing to open port 22 to: refused, not dropped
        raise GpuprovError(f"--ssh-cidr {spec.ssh_cidr}: {cloud} nodes get no public address "
                           f"({entry['no_public_address']}); {entry['method'].upper()} reaches them: drop --ssh-cidr")
    return Access(method=entry["method"], user=user, proxy=entry.get("proxy"), head=head, source=source)


def access_notes(access: Any, time_hours: float) -> list[str]:
    """How the operator reaches the nodes, and what the jump host costs over the run."""
    if access is None or access.user is None:  # on-prem: the hosts file says how
        return []
    if access.method == "bastion" and access.head is not None:
        head = access.head
        return [f"Access: ProxyJump through the head, a {head.size} VM with a public address "
                f"(${head.price_per_hour_usd:,.4f}/h, ${head.price_per_hour_usd * time_hours:,.2f} over the run); "
                "set bastion_cidr in terraform.tfvars to the address you connect from"]
    return [f"Access: {access.method} ({access.source})"]


def _shared(cloud: str, nodes: int, needs: Any, tokens: int, nfs: str | None = None) -> Any:
    entry = cat.shared_storage(cloud)
    if nodes < 2 or entry is None:
        return None
    need = needs.checkpoint_bytes * needs.checkpoints_kept + tokens * rules()["nvme"]["bytes_per_token"]
    options = {k: v for k, v in entry.items()
               if k not in ("kind", "min_gib", "step_gib", "source", "large_min_gib", "large_step_gib", "max_gib")}
    if nfs:  # on-prem: the export the user named (--shared-nfs)
        options["export"] = nfs
    return SharedStorage(kind=entry["kind"], size_gib=cat.shared_size_gib(entry, need), need_bytes=need,
                         options=options, source=entry["source"])


def bringup_fields(spec: Any, inst: Any, nodes: int, needs: Any) -> dict[str, Any]:
    """Plan keyword arguments: purchase, image, access, shared_storage, bundle_id, scheduler."""
    from gpuprov.scheduler import decide

    cloud = inst.cloud
    image = None if cloud == "onprem" else _image(cloud)
    hosts = list(spec.hosts[:nodes]) if inst.onprem and spec.hosts else None
    shared = _shared(cloud, nodes, needs, spec.tokens, spec.shared_nfs if cloud == "onprem" else None)
    return {
        "scheduler": decide(spec, cloud, nodes, hosts, instance=inst, shared_mount=shared.mount_point if shared else None),
        "purchase": _purchase(spec, inst),
        "image": image,
        "access": _access(cloud, image.user if image else None, spec),
        "shared_storage": shared,
        "bundle_id": bundle_id(spec),
    }


def purchase_alternatives(spec: Any, best: Any) -> list[Any]:
    """What the chosen run would cost under the chosen type's other purchase options."""
    inst = best.instance
    if inst.onprem:
        return []
    allowed = cat.allowed_options(spec)
    out = []
    region = spec.region if spec.region and spec.cloud == inst.cloud else None
    for offer in cat.offers(inst, region):
        if offer.option == inst.purchase:
            continue
        cost = None if offer.price_per_hour_usd is None else round(best.time_hours * best.nodes * offer.price_per_hour_usd, 2)
        why = [f"{offer.option}: " + (f"${offer.price_per_hour_usd:,.2f}/h per node" if offer.price_per_hour_usd
                                      is not None else "no public price")]
        if offer.option not in allowed:
            why.append("not allowed (add it to --purchase)")
        elif offer.needs and cat.held(spec, offer, inst.cloud) is None:
            why.append("needs " + get_target(inst.cloud).held_flag)
        if offer.preemptible:
            why.append("preemptible: relies on checkpoint/resume")
        out.append(Alternative(cloud=inst.cloud, instance_type=inst.name, gpu=inst.gpu, nodes=best.nodes,
                               total_gpus=best.total_gpus, sharding=best.sharding,
                               time_hours=round(best.time_hours, 3), cost_usd=cost, reason="; ".join(why),
                               purchase=offer.option))
    return out


def purchase_notes(spec: Any, plan_purchase: Any, inst: Any, time_hours: float, nodes: int,
                   shared: Any) -> list[str]:
    """What the chosen purchase option and storage mean for the run."""
    if inst.onprem:
        return []
    notes = [f"Purchase: {plan_purchase.option} ({inst.name}; options it is sold with: "
             f"{', '.join(cat.offered_options(inst))})"]
    if plan_purchase.risk:
        notes.append(f"{plan_purchase.option}: {plan_purchase.risk}")
    if plan_purchase.preemptible and nodes > 1 and getattr(spec, "slurm", "auto") != "none":
        target = get_target(inst.cloud)
        name = "under its name" if target.keeps_node_names else "with a node under a new name (a scale set)"
        after = (f"`gpuprov up` replaces it {name} and the job resumes from the newest checkpoint on the "
                 "shared filesystem" if target.replaces_lost_nodes else
                 f"nothing replaces a reclaimed node on {target.title} yet: the job waits until the node is back")
        notes.append(f"{plan_purchase.option}: a reclaimed node fails the Slurm job, which is requeued "
                     f"(--requeue); {after}")
    if plan_purchase.max_run_hours and time_hours > plan_purchase.max_run_hours:
        notes.append(f"The run takes {time_hours:,.0f} h, longer than one {plan_purchase.option} lease of "
                     f"{plan_purchase.max_run_hours:g} h: re-apply to get new VMs and resume from the last checkpoint")
    held = get_target(inst.cloud).held_note(plan_purchase.option, plan_purchase.held)
    if held:
        notes.append(held)
    if nodes > 1 and shared is None:
        notes.append(f"No managed shared filesystem is rendered for {inst.cloud}: mount one at /shared "
                     "before training, or checkpoints stay on node-local disks")
    return notes
