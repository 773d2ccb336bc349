"""The candidates table of a plan (best layout per GPU type on each cloud) and warnings on odd picks.

Pure functions of the search result: the CLI prints the rows, `--json` carries them, and the
warnings say when the chosen run is legal but unwise (its GPUs mostly wait on the network).
"""

from __future__ import annotations

from typing import Any, Callable

from gpuprov.sizing.time_error import time_range
from gpuprov.plan import CandidateRow
from gpuprov.planning.space import objective_key
from gpuprov.planning.space import setup_for

# The chosen run is flagged when its MFU falls below this share of the GPU class's assumed
# utilisation: most of each step is then exposed communication, not compute.
LOW_MFU_SHARE = 0.35
TABLE_ROWS = 12  # the terminal table stops here; --json carries every row


def purchase_of(cand: Any) -> str:
    """The purchase option of a candidate's offer (spot, reserved, ...); on-demand when unsaid."""
    if cand.instance.onprem:
        return "owned"
    for obj in (cand, cand.instance):
        value = getattr(obj, "purchase", None)
        if value:
            return str(getattr(value, "name", value))
    return "on-demand"


def layout_label(sharding: str, shard_group: int, total_gpus: int, tp: int = 1, cp: int = 1, pp: int = 1) -> str:
    """How the GPUs split the work, numbers multiplying to the GPU count: "TP8 x FSDP 16", "HSDP 8x4",
    "PP4 x TP8 x FSDP 2". `shard_group`: the GPUs of one model replica, all its pipeline stages."""
    mp = tp * cp * pp
    dp = total_gpus // mp
    head = "".join(f"{name}{n} x " for name, n in (("PP", pp), ("TP", tp), ("CP", cp)) if n > 1)
    if sharding == "hsdp":
        shard = max(1, shard_group // mp)
        return f"{head}HSDP {shard}x{dp // shard}"
    name = {"none": "1 GPU", "ddp": "DDP", "zero2": "ZeRO-2", "fsdp": "FSDP"}.get(sharding, sharding)
    return name if sharding == "none" else f"{head}{name} {dp}"


def _objective_key(objective: str) -> Callable[[Any], tuple]:
    return lambda c: objective_key(objective, c)


def candidate_rows(spec: Any, arch: Any, result: Any, best: Any, estimator: Callable) -> list[Any]:
    """Rows for the table: each (cloud, GPU) group's best, ranked by the objective, chosen marked."""
    cands = sorted(result.best_by_group.values(), key=_objective_key(spec.objective))
    rows = []
    for c in cands:
        mem = estimator(arch, setup_for(spec, arch, c))
        price = c.instance.price_per_hour_usd
        region = spec.region if spec.region and spec.cloud == c.instance.cloud else c.instance.region
        rows.append(CandidateRow(
            cloud=c.instance.cloud, region=region, instance_type=c.instance.name, gpu=c.instance.gpu,
            gpus_per_node=c.instance.gpus, nodes=c.nodes, purchase=purchase_of(c),
            price_per_hour_usd=None if price is None else round(price * c.nodes, 2),
            time_hours=round(c.time_hours, 3), cost_usd=None if c.cost_usd is None else round(c.cost_usd, 2),
            mfu=c.step.mfu, time_hours_range=list(time_range(c.time_hours, c.steps * c.step.step_time_s / 3600.0)),
            per_gpu_bytes=mem.per_gpu_bytes, gpu_memory_bytes=c.gpu.memory_bytes,
            sharding=c.sharding, layout=layout_label(c.sharding, c.shard_group, c.total_gpus, c.tp, c.cp, c.pp),
            bound=c.step.bound, chosen=c is best))
    front = pareto_front([(r.time_hours, r.cost_usd) for r in rows])
    return [r.model_copy(update={"pareto": i in front}) if i in front else r for i, r in enumerate(rows)]


def pareto_front(points: list[tuple[float, float | None]]) -> set[int]:
    """Indexes of the (hours, cost) points no other point beats on both (ties kept); unpriced: never."""
    priced = [(h, c, i) for i, (h, c) in enumerate(points) if c is not None]
    return {i for h, c, i in priced
            if not any((h2 <= h and c2 <= c) and (h2 < h or c2 < c) for h2, c2, _ in priced)}


def pick_warnings(spec: Any, best: Any, rows: list[Any], min_gbps_per_gpu: float) -> list[str]:
    """Say when the chosen run is pathological: network-starved GPUs, or nodes on a thin fabric."""
    out: list[str] = []
    util = best.step.utilisation
    if best.nodes > 1 and best.instance.fabric_gbps_per_gpu < min_gbps_per_gpu:
        out.append(f"{best.nodes} nodes talk over {best.instance.fabric} at {best.instance.fabric_gbps_per_gpu:g} "
                   f"Gb/s per GPU, under the {min_gbps_per_gpu:g} Gb/s per GPU multi-node rule of thumb")
    if best.step.mfu < LOW_MFU_SHARE * util:
        comm = best.step.exposed_comm_s / best.step.step_time_s if best.step.step_time_s else 0.0
        better = [r for r in rows if not r.chosen and r.mfu >= LOW_MFU_SHARE * util]
        hint = ""
        if better:
            r = better[0]
            hint = (f"; {r.nodes} x {r.instance_type} ({r.cloud}) keeps its GPUs busy (MFU {r.mfu:.1%}, "
                    f"{r.time_hours:,.0f} h)")
        out.append(f"the GPUs mostly wait: MFU {best.step.mfu:.1%} against {util:.0%} possible on this GPU class; "
                   f"{comm:.0%} of each step is communication that compute cannot hide{hint}")
    if out and spec.objective == "gpus":
        out.append("--objective gpus minimises the GPU count, not time or cost; --objective cost or time "
                   "weighs what the run takes")
    return out
