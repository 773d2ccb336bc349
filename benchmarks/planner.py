#!/usr/bin/env python3
"""Planner speed over the full catalog, and the planner against an exhaustive brute force.

    python benchmarks/planner.py [--repeat 5] [--no-brute] [--json]

Speed: `make_plan` (search + the whole Plan) on every instance type of every cloud, timed warm
(catalogs parsed once, as in a long-lived process; the cold first call is shown too). CPU time
(process_time) is the figure to read on a shared machine; wall time is printed beside it. Brute force:
`search(..., exhaustive=True)` walks the same space with every pruning off (no instance dominance,
no lower-bound cut-offs, no micro-batch or recompute short-cuts, no memory cache); the planner's
answer must cost (time, GPUs for those objectives) no more than the brute-force optimum.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CASES = [
    dict(model="70b", tokens=20 * 10**9),
    # 200B tokens in 30 days: a batch wide enough for ~100+ GPUs (8 sequences would cap the data parallelism)
    dict(model="70b", tokens=2 * 10**11, deadline_hours=30 * 24, global_batch=256),
    dict(model="llama-3.1-8b", tokens=10**11),
    dict(model="llama-3.1-8b", tokens=5 * 10**10, deadline_hours=48),
    dict(model="llama-3.1-8b", task="lora", tokens=10**9),
    dict(model="70b", task="qlora", tokens=10**9),
    dict(model="llama-3.1-8b", tokens=10**10, objective="time"),
    dict(model="70b", task="lora", tokens=10**9, objective="gpus"),
]


def _label(case: dict) -> str:
    bits = [case["model"], case.get("task", "full"), f"{case['tokens'] / 1e9:g}B tok"]
    if case.get("deadline_hours"):
        bits.append(f"<= {case['deadline_hours']:g} h")
    if case.get("objective"):
        bits.append(f"by {case['objective']}")
    return ", ".join(bits)


def _score(c, objective: str):
    if c is None:
        return None
    return {"cost": c.cost_usd, "time": c.time_hours, "gpus": c.total_gpus}[objective]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-brute", action="store_true", help="speed only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from gpuprov.catalog.gpus import get_gpu
    from gpuprov.catalog.instances import list_instances
    from gpuprov.catalog.models import get_model
    from gpuprov.planner import make_plan, search
    from gpuprov.sizing.memory import estimate_memory
    from gpuprov.spec import TrainingSpec

    t0 = time.perf_counter()
    make_plan(TrainingSpec(**CASES[0]))
    cold = time.perf_counter() - t0
    instances = list_instances()
    rows = []
    for case in CASES:
        spec = TrainingSpec(**case)
        arch = get_model(spec.model)
        times, cpu = [], []
        for _ in range(args.repeat):
            t, c = time.perf_counter(), time.process_time()
            plan = make_plan(spec)
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        planned = search(spec, arch, estimator=estimate_memory, instances=instances, gpu_lookup=get_gpu)
        row = {
            "case": _label(case), "objective": spec.objective,
            "plan_ms_median": statistics.median(times) * 1e3, "plan_ms_max": max(times) * 1e3,
            "plan_cpu_ms_median": statistics.median(cpu) * 1e3,
            "chosen": f"{plan.cluster.nodes} x {plan.cluster.instance_type} {plan.cluster.sharding}"
                      f"/{plan.cluster.activation_checkpointing}/mb{plan.cluster.micro_batch}",
            "planner_score": _score(planned.best, spec.objective),
            "planner_evaluated": planned.evaluated, "planner_memory_calls": planned.memory_calls,
        }
        if not args.no_brute:
            t = time.perf_counter()
            brute = search(spec, arch, estimator=estimate_memory, instances=instances, gpu_lookup=get_gpu,
                           exhaustive=True)
            row.update({
                "brute_s": time.perf_counter() - t,
                "brute_score": _score(brute.best, spec.objective),
                "brute_evaluated": brute.evaluated, "brute_memory_calls": brute.memory_calls,
            })
            p, b = row["planner_score"], row["brute_score"]
            row["ok"] = (p is None and b is None) or (p is not None and b is not None and p <= b * (1 + 1e-12))
        rows.append(row)

    if args.json:
        print(json.dumps({"cold_first_plan_s": cold, "instances": len(instances), "rows": rows}, indent=2))
    else:
        print(f"catalog: {len(instances)} instance types and templates; cold first plan {cold:.2f} s "
              f"(includes parsing the YAML catalogs)\n")
        head = "| case | chosen | plan CPU ms | plan wall ms (median / max) | timed / memory calls |"
        sep = "|---|---|---|---|---|"
        if not args.no_brute:
            head += " planner score | brute-force score | brute timed / memory calls | brute s | planner <= brute |"
            sep += "---|---|---|---|---|"
        print(head)
        print(sep)
        for r in rows:
            line = (f"| {r['case']} | {r['chosen']} | {r['plan_cpu_ms_median']:.0f} | "
                    f"{r['plan_ms_median']:.0f} / {r['plan_ms_max']:.0f} | "
                    f"{r['planner_evaluated']} / {r['planner_memory_calls']} |")
            if not args.no_brute:
                fmt = (lambda v: "-" if v is None else (f"{v:,.2f}" if isinstance(v, float) else str(v)))
                line += (f" {fmt(r['planner_score'])} | {fmt(r['brute_score'])} | {r['brute_evaluated']} / "
                         f"{r['brute_memory_calls']} | {r['brute_s']:.1f} | {'yes' if r['ok'] else 'NO'} |")
            print(line)
    if not args.no_brute and not all(r["ok"] for r in rows):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
