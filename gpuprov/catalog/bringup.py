"""Bring-up facts (data/purchase.yaml, data/bringup.yaml): how an instance type can be bought, the
image it boots, how nodes are reached, and the shared filesystem for checkpoints.

Pure lookups: the planner turns them into Plan fields, the renderers read only the Plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from gpuprov.catalog import load_data
from gpuprov.catalog.regions import region_entry
from gpuprov.errors import GpuprovError
from gpuprov.targets import get_target
from gpuprov.units import GiB

PURCHASE_OPTIONS: tuple[str, ...] = ("on-demand", "spot", "capacity-block", "reservation", "flex-start")


@dataclass(frozen=True)
class Offer:
    """One way to buy one instance type, with its hourly price (None: no public price)."""

    option: str
    price_per_hour_usd: float | None
    price_date: str | None
    price_source: str
    preemptible: bool
    needs: str | None  # spec field the user must set (capacity_reservation_id / reservation)
    reservation_bound: bool
    max_run_hours: float | None
    risk: str | None
    source: str


@lru_cache(maxsize=None)
def _purchase() -> dict:
    data = load_data("purchase.yaml")
    for name in data["options"]:
        if name not in PURCHASE_OPTIONS:
            raise ValueError(f"purchase.yaml: unknown option {name!r}")
    return data


def offered_options(inst: Any) -> tuple[str, ...]:
    """The purchase options the catalog says this instance type can be bought with."""
    data = _purchase()
    entry = data["instances"].get(inst.name)
    if entry is not None:
        return tuple(entry["offers"])
    cloud = data["clouds"].get(inst.cloud)
    return tuple(cloud["offers"]) if cloud else ()


def offers(inst: Any, region: str | None = None) -> list[Offer]:
    """Every offer of this instance type, priced (spot: in `region`, default the type's own)."""
    data = _purchase()
    entry = data["instances"].get(inst.name, {})
    source = entry.get("source") or data["clouds"][inst.cloud]["source"]
    out = []
    for option in offered_options(inst):
        meta = data["options"][option]
        price, date, price_source = _price(inst, option, entry, data, region or inst.region)
        out.append(Offer(option=option, price_per_hour_usd=price, price_date=date, price_source=price_source,
                         preemptible=bool(meta["preemptible"]), needs=meta.get("needs"),
                         reservation_bound=option == "reservation" and bool(entry.get("reservation_bound")),
                         max_run_hours=meta.get("max_run_hours"), risk=meta.get("risk"),
                         source=f"{source}; {meta['source']}"))
    return out


def _price(inst: Any, option: str, entry: dict, data: dict, region: str | None = None
           ) -> tuple[float | None, str | None, str]:
    if option == "spot":  # per region, from spot.yaml
        from gpuprov import spot

        sp = spot.price(inst.name, inst.cloud, region)
        if sp is not None:
            return sp.usd, sp.date, f"spot in {sp.region}: {sp.source}"
        return None, None, f"no spot price recorded for {inst.name} in {region} (catalog/data/spot.yaml)"
    own = (entry.get("prices") or {}).get(option)
    if own is not None:
        return float(own["usd"]), str(own["date"]), f"{entry['source']} ({own.get('region', inst.region)})"
    billed = data["billing"].get(option)
    if option == "on-demand" or billed in ("on-demand", "upper-bound"):
        note = "" if option == "on-demand" else f" ({option}: {billed} rate; {data['billing']['source']})"
        return inst.price_per_hour_usd, inst.price_date, f"{inst.price_source}{note}"
    return None, None, "no public price (spot prices move with demand)"


def allowed_options(spec: Any) -> tuple[str, ...]:
    """What the user allows: `purchase:` when given, else the default plus what the user holds."""
    named = getattr(spec, "purchase", None)
    if named:
        return tuple(named)
    allowed = list(_purchase()["default_allowed"])
    if spec.capacity_reservation_id:
        allowed += ["reservation", "capacity-block"]
    if spec.reservation:
        allowed.append("reservation")
    return tuple(dict.fromkeys(allowed))


def held(spec: Any, offer: Offer, cloud: str) -> str | None:
    """The id the user holds for this offer (None when the offer needs nothing or it is missing)."""
    if offer.needs is None:
        return None
    return get_target(cloud).held_id(spec, offer.option)


def buyable(spec: Any, inst: Any) -> list[Offer]:
    """Offers the user allows and can use (an option that needs a reservation needs its id)."""
    allowed = allowed_options(spec)
    region = getattr(spec, "region", None) if getattr(spec, "cloud", "any") == inst.cloud else None
    return [o for o in offers(inst, region) if o.option in allowed
            and (o.needs is None or held(spec, o, inst.cloud) is not None)]


def best_offer(spec: Any, inst: Any) -> Offer | None:
    """The cheapest usable offer; ties (a reservation bills at the on-demand rate) by preference.

    One offer per instance type is enough for the search: offers of one type differ only in price,
    so the cheapest wins under every objective (time and GPU count break ties on cost)."""
    order = _purchase()["preference"]
    usable = buyable(spec, inst)
    if not usable:
        return None
    return min(usable, key=lambda o: (o.price_per_hour_usd is None,
                                      o.price_per_hour_usd if o.price_per_hour_usd is not None else math.inf,
                                      order.index(o.option)))


@lru_cache(maxsize=None)
def _bringup() -> dict:
    return load_data("bringup.yaml")


def image(cloud: str) -> dict:
    """The GPU-ready image entry for a cloud (on-prem: none)."""
    try:
        return dict(_bringup()["images"][cloud])
    except KeyError:
        raise GpuprovError(f"no image for cloud {cloud!r} in bringup.yaml") from None


def access(cloud: str) -> dict:
    return dict(_bringup()["access"][cloud])


def load_flex_start(cloud: str) -> dict:
    return dict(_bringup()["flex_start"][cloud])


def node_launch(cloud: str) -> dict:
    """How the cloud's bundle requests its nodes all-or-nothing ({} where no such fact is recorded)."""
    return dict(_bringup().get("node_launch", {}).get(cloud, {}))


def provider_support(cloud: str) -> dict:
    """{provisioning model: {since, pin, source}} the cloud's Terraform provider sends only from some release on."""
    return {k: v for k, v in _bringup().get("provider_support", {}).get(cloud, {}).items() if isinstance(v, dict)}


def provider_pin(cloud: str, model: str | None) -> tuple[str, str]:
    """The provider version constraint a bundle pins, and why: the default line, or the one a
    provisioning model needs (FLEX_START, RESERVATION_BOUND on GCP)."""
    entry = _bringup().get("provider_support", {}).get(cloud, {})
    fact = entry.get(model or "")
    if fact and fact.get("pin"):
        return str(fact["pin"]), f"{model} is sent as written from {fact['since']}: {' '.join(str(fact['source']).split())}"
    return str(entry.get("default_pin", "")), "the provider line the templates are schema-checked against"


def shared_storage(cloud: str) -> dict | None:
    entry = _bringup()["shared_storage"].get(cloud)
    return dict(entry) if entry else None


def shared_size_gib(entry: dict, need_bytes: int) -> int:
    """The smallest size the filesystem can be created with that holds need_bytes (0: elastic)."""
    low, step = int(entry["min_gib"]), int(entry["step_gib"])
    if step == 0:
        return 0
    need = max(1, math.ceil(need_bytes / GiB))
    if need <= low:
        return low
    if entry["kind"] == "fsx-lustre":  # 1200, 2400, then multiples of 2400
        return max(2400, math.ceil(need / step) * step)
    size = low + math.ceil((need - low) / step) * step
    if "large_min_gib" in entry and size >= int(entry["large_min_gib"]):  # a range with coarser steps
        big, big_step = int(entry["large_min_gib"]), int(entry["large_step_gib"])
        size = big + max(0, math.ceil((need - big) / big_step)) * big_step
        if size > int(entry["max_gib"]):
            raise GpuprovError(f"{entry['kind']}: {need} GiB needed, more than its {entry['max_gib']} GiB maximum")
    return size


def known_regions(cloud: str) -> tuple[tuple[str, ...], str]:
    """The cloud's region names and their source (one list: catalog/data/regions.yaml)."""
    entry = region_entry(cloud)
    return (tuple(entry["regions"]), entry["source"]) if entry else ((), "")


def quota(cloud: str) -> dict | None:
    entry = _bringup()["quotas"].get(cloud)
    return dict(entry) if entry else None


def dataset_download(scheme: str) -> dict:
    """How a node copies a dataset URI of this store to the cluster (argv template, env, source)."""
    entry = _bringup()["dataset_download"].get(scheme)
    if entry is None:
        raise GpuprovError(f"no recorded way to download a {scheme}:// dataset on the nodes")
    return dict(entry)
