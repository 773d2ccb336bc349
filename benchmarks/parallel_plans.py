#!/usr/bin/env python3
"""The planner's layouts (TP x CP x FSDP) for the Llama 3.1 family beside published training figures.

    python benchmarks/parallel_plans.py [--json]

References (BF16 unless noted):
  * meta-llama/llama-models models/llama3_1/MODEL_CARD.md: training time 1.46M (8B), 7.0M (70B) and
    30.84M (405B) H100-80GB GPU-hours for ~15.6T tokens (Dubey et al. 2024, sec. 3.1.1), i.e. GPU-hours
    per 1T tokens; these include failures, restarts and long-context stages, so a plan should come
    out at or a little below them.
  * Dubey et al. 2024, The Llama 3 Herd of Models (arXiv:2407.21783), Table 4: 405B on 8,192-16,384
    H100s with TP 8 (+ CP, PP, FSDP) at 38-43% BF16 MFU.
  * pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md: 70B 2-D (FSDP 32 x TP 8) and
    405B 3-D (FSDP x TP 8 x PP 8) -- with Float8, so its TPS/GPU are an upper bound for BF16.

Prints, per model: the chosen layout, MFU, tokens/s per GPU and GPU-hours per 1T tokens, and the
ratio to the model card. Target: the 405B plan uses TP on Hopper nodes, MFU within MFU_RANGE, and
GPU-hours within GPU_HOURS_RATIO of the model card.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MODEL_CARD_GPU_HOURS = {"llama-3.1-8b": 1.46e6, "llama-3.1-70b": 7.0e6, "llama-3.1-405b": 30.84e6}
MODEL_CARD_TOKENS = 15.6e12
MFU_RANGE = (0.30, 0.43)
GPU_HOURS_RATIO = (0.7, 1.3)


def run() -> list[dict]:
    from gpuprov.planner import make_plan
    from gpuprov.spec import TrainingSpec

    rows = []
    for model in ("llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b"):
        spec = TrainingSpec(model=model, tokens=10**12, init="random")  # pre-training, as the model card measured
        t0 = time.perf_counter()
        p = make_plan(spec)
        seconds = time.perf_counter() - t0
        c, t = p.cluster, p.throughput
        gpu_hours = p.time_hours * c.total_gpus
        ref = MODEL_CARD_GPU_HOURS[model] / (MODEL_CARD_TOKENS / 1e12)
        rows.append({
            "model": model, "gpu": c.gpu, "nodes": c.nodes, "gpus": c.total_gpus, "tp": c.tp, "cp": c.cp,
            "sharding": c.sharding, "ac": c.activation_checkpointing, "mfu": t.mfu,
            "tokens_per_s_per_gpu": t.tokens_per_s / c.total_gpus, "gpu_hours_per_T": gpu_hours,
            "model_card_gpu_hours_per_T": ref, "ratio": gpu_hours / ref, "plan_seconds": seconds,
        })
    return rows


def render(rows: list[dict]) -> str:
    lines = [f"{'model':<16}{'layout':<30}{'MFU':>7}{'tok/s/GPU':>11}{'GPU-h/1T':>12}{'card':>12}{'ratio':>7}{'plan s':>8}"]
    for r in rows:
        lay = f"{r['nodes']}x8 {r['gpu'][:4]} tp{r['tp']} cp{r['cp']} {r['sharding']} {r['ac'][:4]}"
        lines.append(f"{r['model']:<16}{lay:<30}{r['mfu']:>7.1%}{r['tokens_per_s_per_gpu']:>11,.0f}"
                     f"{r['gpu_hours_per_T']:>12,.0f}{r['model_card_gpu_hours_per_T']:>12,.0f}{r['ratio']:>7.2f}"
                     f"{r['plan_seconds']:>8.2f}")
    big = rows[-1]
    ok = (big["tp"] > 1 and big["gpu"] in ("h100-80gb", "h200-141gb") and MFU_RANGE[0] <= big["mfu"] <= MFU_RANGE[1]
          and GPU_HOURS_RATIO[0] <= big["ratio"] <= GPU_HOURS_RATIO[1])
    lines.append("")
    lines.append(f"405B: TP on Hopper, MFU in {MFU_RANGE[0]:.0%}-{MFU_RANGE[1]:.0%} (Llama 3 Table 4: 38-43%), GPU-hours within "
                 f"{GPU_HOURS_RATIO[0]}-{GPU_HOURS_RATIO[1]}x the model card: {'PASS' if ok else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = run()
    print(json.dumps(rows, indent=2) if args.json else render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
