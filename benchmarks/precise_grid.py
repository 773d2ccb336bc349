#!/usr/bin/env python3
"""Where the analytic memory model drifts from precise mode, over a grid of configurations.

    python benchmarks/precise_grid.py [--models llama-3.2-1b,llama-2-7b] [--tasks full,lora,qlora]
        [--ac none,selective,full] [--seq 2048,8192] [--gpus 1,8] [--micro-batch 1] [--json]

For every combination it runs the analytic estimate (gpuprov.sizing.memory) and precise mode
(gpuprov.sizing.precise: one simulated step on fake tensors) and prints per-GPU peaks, the
analytic model's signed disagreement with precise mode, and the terms that differ most. One GPU
runs unsharded (`none`), more run FSDP2. Precise mode costs ~1-2 s per decoder layer on one CPU
core: a 7B configuration takes about a minute, so widen the grid deliberately.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from itertools import product
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GIB = 2**30


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def term_differences(analytic: dict[str, int], precise: dict[str, int], top: int = 3) -> list[tuple[str, int]]:
    """(term, analytic - precise bytes) for the terms that differ most, largest first."""
    terms = set(analytic) | set(precise)
    diffs = [(t, analytic.get(t, 0) - precise.get(t, 0)) for t in terms]
    diffs = [d for d in diffs if d[1]]
    return sorted(diffs, key=lambda d: -abs(d[1]))[:top]


def run_grid(models, tasks, acs, seqs, gpus_list, micro_batch: int, progress=None) -> list[dict]:
    from gpuprov.catalog.models import get_model
    from gpuprov.sizing.memory import estimate_memory
    from gpuprov.sizing.precise import estimate_precise
    from gpuprov.sizing.setup import make_setup

    rows = []
    for model, task, ac, seq, gpus in product(models, tasks, acs, seqs, gpus_list):
        arch = get_model(model)
        setup = make_setup(
            framework=None, grad_accum=1, task=task, seq_len=seq, micro_batch=micro_batch, gpus=gpus,
            gpus_per_node=8, sharding="fsdp" if gpus > 1 else "none", activation_checkpointing=ac,
        )
        analytic = estimate_memory(arch, setup)
        t0 = time.monotonic()
        precise = estimate_precise(arch, setup)
        seconds = time.monotonic() - t0
        diff = (analytic.per_gpu_bytes - precise.per_gpu_bytes) / precise.per_gpu_bytes * 100
        row = {
            "model": model, "task": task, "ac": ac, "seq_len": seq, "gpus": gpus,
            "sharding": setup.sharding,
            "analytic_bytes": analytic.per_gpu_bytes, "precise_bytes": precise.per_gpu_bytes,
            "analytic_minus_precise_pct": round(diff, 2),
            "top_term_differences": term_differences(analytic.breakdown, precise.breakdown),
            "precise_seconds": round(seconds, 1),
        }
        rows.append(row)
        if progress:
            progress(row)
    return rows


def format_row(r: dict) -> str:
    terms = ", ".join(f"{t} {d / GIB:+.2f}" for t, d in r["top_term_differences"])
    return (
        f"{r['model']:<14} {r['task']:<6} {r['ac']:<9} {r['seq_len']:>6} {r['gpus']:>4} "
        f"{r['analytic_bytes'] / GIB:>9.2f} {r['precise_bytes'] / GIB:>9.2f} "
        f"{r['analytic_minus_precise_pct']:>+7.1f}% {r['precise_seconds']:>6.1f}s  {terms}"
    )


HEADER = (
    f"{'model':<14} {'task':<6} {'ac':<9} {'seq':>6} {'gpus':>4} {'analytic':>9} {'precise':>9} "
    f"{'diff':>8} {'sim':>7}  largest term differences (analytic - precise, GiB)"
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="llama-3.2-1b")
    p.add_argument("--tasks", default="full,lora,qlora")
    p.add_argument("--ac", default="none,selective,full")
    p.add_argument("--seq", default="2048")
    p.add_argument("--gpus", default="1,8")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    if not a.json:
        print("per-GPU peak in GiB; diff = (analytic - precise) / precise")
        print(HEADER)
    rows = run_grid(
        _csv(a.models), _csv(a.tasks), _csv(a.ac), [int(x) for x in _csv(a.seq)],
        [int(x) for x in _csv(a.gpus)], a.micro_batch,
        progress=None if a.json else (lambda r: print(format_row(r), flush=True)),
    )
    if a.json:
        print(json.dumps(rows, indent=2))
    else:
        diffs = [abs(r["analytic_minus_precise_pct"]) for r in rows]
        worst = max(rows, key=lambda r: abs(r["analytic_minus_precise_pct"]))
        print(
            f"\n{len(rows)} configurations: mean |diff| {sum(diffs) / len(diffs):.1f}%, "
            f"worst {worst['analytic_minus_precise_pct']:+.1f}% "
            f"({worst['model']} {worst['task']} ac={worst['ac']} seq={worst['seq_len']} gpus={worst['gpus']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
