"""Spot: the price per region (catalog/data/spot.yaml) and what preemption adds to a run.

Expected time on spot: every interruption of any node stops the job, which then loses the work
since its last checkpoint (half a checkpoint interval on average) and waits `restart_hours` to boot
and reload. With interruptions arriving at `nodes x rate` per hour, the lost time is itself exposed
to interruptions, so the run takes T / (1 - nodes x rate x loss) (a renewal argument; it grows
without bound as the product nears 1, when a run on that many spot nodes would rarely finish).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from gpuprov.catalog import load_data


def _data() -> dict:
    return load_data("spot.yaml")


@dataclass(frozen=True)
class SpotPrice:
    """A spot price snapshot of one instance type in one region, with its date and source."""
    usd: float
    region: str
    date: str | None  # when the snapshot was taken (None: not recorded)
    source: str


def price(instance: str, cloud: str, region: str | None) -> SpotPrice | None:
    """The recorded spot price of this type in this region (None where none is recorded)."""
    by_region = (_data()["prices"] or {}).get(instance) or {}
    if region is None or region not in by_region:
        return None
    snap = _data()["snapshots"][cloud]
    return SpotPrice(float(by_region[region]), region, snap.get("date"), f"{snap['source']}; {snap['date_basis']}")


def other_regions(instance: str, region: str | None) -> list[tuple[str, float]]:
    """Spot prices of this type in the catalog's other regions, cheapest first."""
    by_region = (_data()["prices"] or {}).get(instance) or {}
    return sorted(((r, float(p)) for r, p in by_region.items() if r != region), key=lambda rp: rp[1])


def interruption_rate_per_node_hour() -> float:
    i = _data()["interruption"]
    return float(i["fraction_per_month"]) / float(i["hours_per_month"])


def overhead_hours(train_hours: float, nodes: int, checkpoint_interval_hours: float) -> float:
    """Expected hours preemption adds to `train_hours` of work on `nodes` spot nodes."""
    i = _data()["interruption"]
    loss = min(checkpoint_interval_hours, train_hours) / 2.0 + float(i["restart_hours"])
    load = nodes * interruption_rate_per_node_hour() * loss
    if load >= 0.95:  # the run would almost never finish; keep the number finite and huge
        load = 0.95
    return train_hours * load / (1.0 - load)


def stale(date: str | None, today: dt.date | None = None) -> str | None:
    """Why a price is stale (older than the limit, or undated), or None when it is fresh."""
    limit = int(_data()["stale_after_days"])
    if date is None:
        return "undated (the source does not say when it was taken)"
    try:
        when = dt.date.fromisoformat(str(date)[:10])
    except ValueError:
        return f"dated {date!r}, not a date"
    age = ((today or dt.date.today()) - when).days
    return f"{age} days old (from {when.isoformat()}; limit {limit})" if age > limit else None


def notes(inst: Any, region: str | None, nodes: int, train_hours: float) -> list[str]:
    """plan's Notes for a spot run: the price and its source, the preemption model, other regions."""
    if getattr(inst, "purchase", None) != "spot":
        return []
    i = _data()["interruption"]
    extra = overhead_hours(train_hours, nodes, 1.0)
    shown = f"{extra:,.2f} h" if extra >= 0.005 else f"{extra * 60:,.1f} min"
    out = [f"Spot: expected time includes {shown} of preemption losses on {nodes} node(s): "
           f"{float(i['fraction_per_month']):.0%} of spot nodes interrupted per month (assumed, the top edge of "
           f"the published interruption buckets), each interruption costing half the 1 h checkpoint interval "
           f"plus {float(i['restart_hours']):g} h to restart (catalog/data/spot.yaml interruption)"]
    if inst.price_per_hour_usd is None:
        out.append(f"Spot: no spot price recorded for {inst.name} in {region}; the plan cannot cost it")
    others = other_regions(inst.name, region)
    if others:
        out.append(f"Spot {inst.name} in other regions ($/h): "
                   + ", ".join(f"{r} {p:,.2f}" for r, p in others) + " (--region to choose)")
    return out
