"""Measured runs fed back into the plan: the trainer's metrics file against its bundle's plan.

`measure` reads launch/train_metrics.py's JSON lines (per logged step: tokens_per_s, mfu,
peak_memory_reserved_bytes; an "end" event with the run's peak) and `compare` sets them beside what
plan.json predicted. `record` is the calibration file `gpuprov calibrate -o` writes, and
`load_calibration` reads it back for `plan/generate --calibration`.

The rule a calibration carries (RULE): the step time of every candidate on the calibrated GPU type
(slug) is multiplied by predicted / measured tokens/s of the measured run. What the time model missed
on that GPU there (its kernels at this software stack, its clocks, its fabric) is taken to carry over to
other models, layouts and node counts of the same GPU type; other GPU types are left as modelled. The
plan notes where its model, layout or power limit differs from the measured run's, where the carry-over
is least certain. Memory is reported, never applied (the plan's memory stays the estimator's).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from gpuprov.errors import GpuprovError

MAX_METRICS_BYTES = 256 << 20  # a metrics line is ~300 bytes: ~800k logged steps
MAX_CALIBRATION_BYTES = 64 << 10
RATIO_RANGE = (0.05, 20.0)  # a measured speed 20x off the plan is a broken run or a wrong bundle, not a calibration
RULE = ("GEMM throughput x the ratio that gives the measured run's own layout its measured tokens/s (the time model's "
        "GEMM term; attention, memory-bound work, launches and communication stay as modelled), on the same GPU type "
        "(slug), carried over to other models, layouts and node counts of that GPU; where no GEMM ratio reaches the "
        "measured speed, step time x predicted/measured tokens/s; memory reported, not applied")


def _number(rec: dict, key: str, where: str) -> float | None:
    value = rec.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise GpuprovError(f"{where}: {key} is {value!r}, expected a non-negative number")
    return float(value)


def measure(text: str, path: str) -> dict[str, Any]:
    """The run's steady-state figures: median tokens/s and MFU of the logged steps after the first (the first
    interval carries compile and warm-up), and the largest peak memory reserved; one-line errors."""
    steps: list[tuple[float, float | None]] = []
    peaks: list[float] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            rec = json.loads(line)
        except ValueError:
            raise GpuprovError(f"{where}: not a JSON object (the trainer's metrics file has one per line)") from None
        if not isinstance(rec, dict):
            raise GpuprovError(f"{where}: not a JSON object (the trainer's metrics file has one per line)")
        peak = _number(rec, "peak_memory_reserved_bytes", where)
        if peak is not None:
            peaks.append(peak)
        tps = _number(rec, "tokens_per_s", where)
        if tps is not None and "step" in rec:
            steps.append((tps, _number(rec, "mfu", where)))
    if not steps:
        raise GpuprovError(f"{path}: no logged step with tokens_per_s (is it launch/train.py's "
                           "logging.metrics_file?)")
    import statistics  # lazy: only reading a run's metrics needs it
    steady = steps[1:] or steps
    mfus = [m for _, m in steady if m is not None]
    tps = statistics.median(t for t, _ in steady)
    if tps <= 0:
        raise GpuprovError(f"{path}: the logged tokens_per_s are zero")
    return {"tokens_per_s": tps, "mfu": statistics.median(mfus) if mfus else None,
            "peak_memory_bytes": int(max(peaks)) if peaks else None, "steps_used": len(steady),
            "steps_logged": len(steps)}


def compare(plan: Any, measured: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of (quantity, measured, predicted, measured / predicted)."""
    t, m = plan.throughput, plan.memory
    rows = [("tokens/s (cluster)", measured["tokens_per_s"], t.tokens_per_s),
            ("MFU", measured["mfu"], t.mfu),
            ("peak memory per GPU (bytes)", measured["peak_memory_bytes"], m.per_gpu_bytes)]
    return [{"quantity": q, "measured": a, "predicted": b,
             "ratio": None if a is None or not b else a / b} for q, a, b in rows]


def record(plan: Any, measured: dict[str, Any], bundle: str, metrics: str) -> dict[str, Any]:
    """The calibration file's content (what --calibration reads back)."""
    c = plan.cluster
    ratio = measured["tokens_per_s"] / plan.throughput.tokens_per_s
    if not RATIO_RANGE[0] <= ratio <= RATIO_RANGE[1]:
        raise GpuprovError(f"{metrics}: measured {measured['tokens_per_s']:,.0f} tokens/s is {ratio:.3g}x the plan's "
                           f"{plan.throughput.tokens_per_s:,.0f}: outside {RATIO_RANGE[0]:g}-{RATIO_RANGE[1]:g}x; "
                           "is this the metrics file of this bundle's run?")
    mem = measured["peak_memory_bytes"]
    gemm = gemm_ratio(plan, ratio)
    return {
        "gpu": c.gpu, "speed_ratio": round(ratio, 4),
        **({"gemm_efficiency_ratio": round(gemm, 6)} if gemm is not None else {}),
        "gpu_power_w": plan.throughput.gpu_power_w,
        "model": plan.spec.model, "task": plan.task, "layout": layout_of(plan),
        "measured_tokens_per_s": round(measured["tokens_per_s"], 1),
        "predicted_tokens_per_s": round(plan.throughput.tokens_per_s, 1),
        "memory_ratio": None if mem is None else round(mem / plan.memory.per_gpu_bytes, 4),
        "source": f"gpuprov calibrate {Path(bundle).name} {Path(metrics).name} (bundle {plan.bundle_id or 'n/a'}; "
                  f"{measured['steps_used']} of {measured['steps_logged']} logged steps)",
        "rule": RULE,
    }


def gemm_ratio(plan: Any, speed_ratio: float) -> float | None:
    """The factor on the GEMMs' achieved throughput at which the plan's own layout runs `speed_ratio` x its
    predicted tokens/s (bisection on log scale over RATIO_RANGE), or None where none does: the measured run
    is faster or slower than any GEMM throughput explains (the rest of its step alone sets its pace)."""
    from gpuprov.planning.retime import plan_step

    if plan.throughput.step_terms_s.get("gemm", 0.0) <= 0.0:
        return None  # a plan timed before the operation model: the whole-step rule
    base = plan_step(plan, 1.0).st.tokens_per_s
    target = base * speed_ratio

    def speed(scale: float) -> float:
        return plan_step(plan, scale).st.tokens_per_s

    lo, hi = math.log(RATIO_RANGE[0]), math.log(RATIO_RANGE[1])
    if not speed(math.exp(lo)) <= target <= speed(math.exp(hi)):
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if speed(math.exp(mid)) < target else (lo, mid)
    return math.exp((lo + hi) / 2)


def layout_of(plan: Any) -> str:
    c = plan.cluster
    return (f"{c.total_gpus} GPUs ({c.nodes} x {c.gpus_per_node}) {c.sharding} tp{c.tp} cp{c.cp} pp{c.pp} "
            f"AC {c.activation_checkpointing} mb{c.micro_batch} ga{c.grad_accum} seq{c.seq_len}")


def dump(rec: dict[str, Any]) -> str:
    lines = ["# gpuprov calibration: a measured run against its plan (plan/generate --calibration FILE).",
             f"# rule: {RULE}"]
    lines += [f"{k}: {json.dumps(v)}" for k, v in rec.items()]
    return "\n".join(lines) + "\n"


def load_calibration(path: str) -> dict[str, Any]:
    """The calibration --calibration names, as the spec stores it: {gpu, speed_ratio, gpu_power_w, model,
    layout, source}; one-line errors."""
    from ruamel.yaml import YAML

    from gpuprov.safefile import read_text

    text = read_text(path, limit=MAX_CALIBRATION_BYTES, follow=True, what="calibration file")
    try:
        data = YAML(typ="safe", pure=True).load(text)
    except Exception as exc:  # ruamel's errors have no common base worth naming here
        raise GpuprovError(f"{path}: not YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict) or "gpu" not in data or "speed_ratio" not in data:
        raise GpuprovError(f"{path}: not a calibration file (gpu and speed_ratio missing; "
                           "write one with `gpuprov calibrate BUNDLE METRICS.jsonl -o FILE`)")
    keep = ("gpu", "speed_ratio", "gemm_efficiency_ratio", "gpu_power_w", "model", "layout", "source")
    return {k: data.get(k) for k in keep if data.get(k) is not None}


def plan_note(spec: Any, gpu: str, model: str, layout: str, power_w: int | None) -> str | None:
    """What the plan's calibration did, and where the chosen run differs from the measured one."""
    cals = list(getattr(spec, "calibration", None) or [])
    if not cals:
        return None
    cal = next((c for c in cals if c.gpu == gpu), None)
    if cal is None:
        return (f"Calibration for {', '.join(c.gpu for c in cals)} not applied: the plan runs on {gpu} "
                "(a calibration carries over to its own GPU type only)")
    differs = [f"{what} ({theirs} measured, {ours} here)" for what, theirs, ours in
               (("model", cal.model, model), ("layout", cal.layout, layout), ("power limit", cal.power_w_text(),
                                                                                f"{power_w} W"))
               if theirs is not None and theirs != ours]
    tail = f"; the measured run differs in {', '.join(differs)}" if differs else "; the measured run is this one"
    if cal.gemm_efficiency_ratio:
        return (f"GEMM throughput x {cal.gemm_efficiency_ratio:.4g} on {gpu}: a measured run ran {cal.speed_ratio:g}x the "
                f"predicted tokens/s ({cal.source or 'calibration file'}), which that ratio on its GEMMs explains; "
                f"rule: {RULE}{tail}")
    return (f"Step time x 1/{cal.speed_ratio:g} on {gpu}: a measured run ran {cal.speed_ratio:g}x the predicted "
            f"tokens/s ({cal.source or 'calibration file'}); rule: {RULE}{tail}")
