"""What the bundle's storage adds to a run: the shared filesystem and boot disks priced over its
hours, and the time checkpoints keep training waiting (catalog/data/storage_prices.yaml).

One function serves the planner (every candidate is ranked on it) and the Plan (which records the
breakdown, so `plan` prints steps x step time + start-up + checkpoint writes + preemption = hours).
Checkpoints: train.py saves synchronously on one GPU and with DCP async_save on more, where only a
save longer than the interval, and the final save the end waits for, hold training up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from gpuprov.units import GiB


CHECKPOINT_INTERVAL_S = 3600.0  # checkpoint about every hour of training (a node failure loses at most an hour)


def checkpoint_every(steps: int, step_s: float, given: int | None = None) -> int:
    """Optimizer steps between checkpoints: `given` (the spec's checkpoint_every_steps), else about
    CHECKPOINT_INTERVAL_S of training; at most the run's steps (its last step is always saved)."""
    if given is not None:
        return max(1, min(steps, given))
    return max(1, min(steps, round(CHECKPOINT_INTERVAL_S / max(step_s, 1e-6))))


@lru_cache(maxsize=1)
def _data() -> dict:
    from gpuprov.catalog import load_data

    return load_data("storage_prices.yaml")


@dataclass(frozen=True)
class StorageTerms:
    """Per-run storage facts of one (cloud, nodes) choice."""

    shared_kind: str | None
    shared_gib: int  # provisioned (0: elastic, billed on the bytes stored)
    shared_usd_per_hour: float | None  # None: no recorded price (not in the cost)
    disks_usd_per_hour: float | None
    write_mb_per_s: float | None  # where checkpoints land (None: no sourced bandwidth: not modelled)
    unpriced: tuple[str, ...]  # items the cost leaves out, in words


def _per_hour(usd_per_gib_month: float | None, gib: float) -> float | None:
    if usd_per_gib_month is None:
        return None
    return float(usd_per_gib_month) * gib / float(_data()["hours_per_month"])


def storage_terms(cloud: str, nodes: int, boot_disk_gib: int, checkpoint_bytes: int, kept: int,
                  dataset_bytes: int) -> StorageTerms:
    """The shared filesystem a multi-node bundle creates (sized as bringup_plan sizes it) and the
    nodes' boot disks, priced per hour; where one checkpoint is written and how fast."""
    from gpuprov.catalog import bringup as cat

    unpriced: list[str] = []
    disk = (_data()["boot_disk"] or {}).get(cloud)
    disks = None if disk is None else _per_hour(disk["price_usd_per_gib_month"], boot_disk_gib * nodes)
    if disk is not None and disks is None:
        unpriced.append(f"{cloud} boot disks")
    entry = cat.shared_storage(cloud) if nodes > 1 else None
    if entry is None:
        return StorageTerms(None, 0, 0.0, disks, None, tuple(unpriced))
    need = checkpoint_bytes * kept + dataset_bytes
    size = cat.shared_size_gib(entry, need)
    facts = _data()["shared"][entry["kind"]]
    billed = size if size else need / GiB  # elastic: the bytes stored
    shared = _per_hour(facts["price_usd_per_gib_month"], billed)
    if shared is None and cloud != "onprem":
        unpriced.append(f"{entry['kind']} (no recorded price)")
    per_tib = facts.get("write_mb_per_s_per_tib")
    write = float(per_tib) * size / 1024 if per_tib and size else None
    return StorageTerms(entry["kind"], size, shared, disks, write, tuple(unpriced))


def checkpoint_hours(terms: StorageTerms, checkpoint_bytes: int, steps: int, every_steps: int,
                     step_s: float, world: int) -> float | None:
    """Hours checkpoint writes hold training up (None: no sourced write bandwidth where they land)."""
    if terms.write_mb_per_s is None:
        return None
    write_s = checkpoint_bytes / (terms.write_mb_per_s * 1e6)
    saves = max(1, math.ceil(steps / max(1, every_steps)))
    if world == 1:  # synchronous: every save stops the step loop
        return saves * write_s / 3600.0
    interval_s = every_steps * step_s
    # async: a save overlaps the next interval; a longer one is waited for, and the end waits for the last
    return (write_s + (saves - 1) * max(0.0, write_s - interval_s)) / 3600.0


def storage_usd_per_hour(terms: StorageTerms) -> float:
    return (terms.shared_usd_per_hour or 0.0) + (terms.disks_usd_per_hour or 0.0)


def undated_prices(cloud: str, shared_kind: str | None) -> list[tuple[str, str | None, str]]:
    """(what, date, source) of the storage prices a plan used (for the staleness warning)."""
    out = []
    disk = (_data()["boot_disk"] or {}).get(cloud)
    if disk and disk.get("price_usd_per_gib_month") is not None:
        out.append((f"{cloud} boot disk price", disk.get("date"), str(disk["source"])))
    if shared_kind:
        facts = _data()["shared"][shared_kind]
        if facts.get("price_usd_per_gib_month") is not None:
            out.append((f"{shared_kind} price", facts.get("date"), str(facts["source"])))
    return out


def checkpoint_bytes_of(trainable: int) -> tuple[int, int]:
    """(bytes of one checkpoint, checkpoints kept): the host rules' figures (host.py host_needs)."""
    from gpuprov.host import rules

    nv = rules()["nvme"]
    return int(trainable * nv["checkpoint_bytes_per_param"]), int(nv["checkpoints_kept"])


def dataset_bytes_of(tokens: int) -> int:
    from gpuprov.host import rules

    return int(tokens * rules()["nvme"]["bytes_per_token"])


def boot_disk_gib(cloud: str) -> int:
    from gpuprov.targets import get_target

    return int(getattr(get_target(cloud), "boot_disk_gib", 0))


def describe(terms: StorageTerms, hours: float) -> str:
    """One line for plan's Notes: what storage adds to the cost."""
    bits = []
    if terms.shared_kind:
        size = f"{terms.shared_gib:,} GiB" if terms.shared_gib else "elastic"
        cost = "not priced" if terms.shared_usd_per_hour is None else \
            f"${terms.shared_usd_per_hour * hours:,.2f} over {hours:,.1f} h"
        bits.append(f"shared filesystem {terms.shared_kind} ({size}): {cost}")
    if terms.disks_usd_per_hour is not None:
        bits.append(f"boot disks ${terms.disks_usd_per_hour * hours:,.2f}")
    if terms.unpriced:
        bits.append("not in the cost: " + ", ".join(terms.unpriced))
    if terms.write_mb_per_s is None:
        where = f"{terms.shared_kind}" if terms.shared_kind else "node-local disks"
        bits.append(f"checkpoint write time not in the hours (no sourced write bandwidth for {where})")
    return "Storage in the cost: " + "; ".join(bits) + " (catalog/data/storage_prices.yaml)" if bits else ""
