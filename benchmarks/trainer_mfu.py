#!/usr/bin/env python3
"""The generated trainer next to torchtitan on the same model shape and GPU: tokens/s, MFU, peak memory.

    python benchmarks/trainer_mfu.py --model llama-3.2-1b --gpus 1 --seq-len 4096 --micro-batch 2 \
        --torchtitan-config llama3_1b.toml         # one GPU machine, torchtitan installed (pinned below)
    python benchmarks/trainer_mfu.py --tiny        # CPU: a tiny shape, the trainer only (checks the wiring)

The trainer runs from a real bundle's launch/ (rendered from a gpuprov plan for the model), shrunk
to this machine with train.py's --set overrides, on synthetic data with fresh weights (speed and
memory do not depend on the values). torchtitan runs `torchtitan.train` with the TOML you give,
overridden to the same steps, seq_len and local batch; its log lines carry tps, mfu and memory.
Prints one row per trainer, their ratios, and gpuprov's predicted peak for the shape (the
estimator on the Plan's stack). Numbers are medians after the first two steps.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

GiB = 2**30
TORCHTITAN_PIN = "torchtitan==0.3.0"  # PyPI release of 2026-09, the one this comparison is written for
TINY = {"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512}


def render_launch_dir(model: str, task: str, root: Path):
    from gpuprov.planner import make_plan
    from gpuprov.render.launch import render_launch
    from gpuprov.spec import TrainingSpec

    plan = make_plan(TrainingSpec(model=model, task=task, cloud="aws", tokens=10**9))
    launch = root / "launch"
    launch.mkdir(parents=True)
    for name, text in render_launch(plan).items():
        (launch / name).write_text(text)
        (launch / name).chmod(0o755)
    return plan, launch


def predicted_peak(plan, args) -> int | None:
    """gpuprov's per-GPU estimate for exactly this shape, on the Plan's stack."""
    if args.tiny:
        return None
    from gpuprov.catalog.models import get_model
    from gpuprov.sizing.setup import make_setup
    from gpuprov.sizing.memory import estimate_memory

    setup = make_setup(task=args.task, seq_len=args.seq_len, micro_batch=args.micro_batch, gpus=args.gpus,
                       gpus_per_node=args.gpus, sharding="fsdp", activation_checkpointing=args.ac,
                       precision=plan.cluster.precision, optimizer="adamw", offload="none",
                       grad_accum=1, stack=plan.stack)
    return estimate_memory(get_model(args.model), setup).per_gpu_bytes


def run_trainer(launch: Path, root: Path, args, peak_tflops: float, float8: bool = False) -> dict:
    metrics = root / ("metrics-float8.jsonl" if float8 else "metrics.jsonl")
    sets = {"parallel.sharding": "fsdp", "parallel.replicate": 1, "parallel.shard": args.gpus,
            "parallel.activation_checkpointing": args.ac, "batch.micro_batch": args.micro_batch,
            "batch.grad_accum": 1, "batch.seq_len": args.seq_len, "schedule.steps": args.steps,
            "schedule.warmup_steps": 2, "checkpoint.every_steps": 0, "checkpoint.dir": str(root / "ckpt"),
            "logging.every_steps": 1, "logging.metrics_file": str(metrics), "data.synthetic": True,
            "model.init": "random", "model.pretrained_path": None, "export.at_end": False,
            "mfu.peak_tflops_per_gpu": peak_tflops, "efficiency.float8": float8}
    if args.tiny:
        sets.update({f"model.hf_config.{k}": v for k, v in TINY.items()})
        sets.update({"runtime.device": "cpu", "precision.param_dtype": "float32"})
    argv = [a for k, v in sets.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    env = dict(os.environ, PYTHON=sys.executable, GPUPROV_NNODES="1", GPUPROV_NPROC_PER_NODE=str(args.gpus),
               GPUPROV_INVENTORY=str(root / "none.yml"), GPUPROV_MAX_RESTARTS="0", HF_HUB_OFFLINE="1")
    proc = subprocess.run(["bash", str(launch / "train.sh"), *argv], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-2000:]}
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    steady = steps[2:] or steps
    end = next(r for r in recs if r.get("event") == "end")
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "mfu": statistics.median(r["mfu"] for r in steady),
            "peak_bytes": end["peak_memory_reserved_bytes"]}


_TT_LINE = re.compile(r"memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%")


def run_torchtitan(args) -> dict:
    if not args.torchtitan_config:
        return {"error": "no --torchtitan-config given"}
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        return {"error": f"torchtitan not installed (pip install {TORCHTITAN_PIN})"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.gpus), "-m",
           "torchtitan.train", "--job.config_file", args.torchtitan_config, "--training.steps", str(args.steps),
           "--training.seq_len", str(args.seq_len), "--training.local_batch_size", str(args.micro_batch),
           "--metrics.log_freq", "1", "--checkpoint.no-enable"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    rows = [m.groups() for m in _TT_LINE.finditer(proc.stdout + proc.stderr)]
    if proc.returncode != 0 or not rows:
        return {"error": (proc.stdout + proc.stderr)[-2000:]}
    steady = rows[2:] or rows
    return {"tokens_per_s": statistics.median(float(t.replace(",", "")) for _, t, _ in steady) * args.gpus,
            "mfu": statistics.median(float(m) for _, _, m in steady) / 100,
            "peak_bytes": int(max(float(g) for g, _, _ in rows) * GiB)}


def fmt(row: dict, key: str, scale: float = 1.0, spec: str = ",.0f") -> str:
    v = row.get(key)
    return "n/a" if v is None else format(v * scale, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--task", default="full", choices=["full", "lora"])
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--ac", default="selective", choices=["none", "selective", "full"])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--peak-tflops", type=float, help="dense bf16 peak of this GPU (default: --gpu's)")
    ap.add_argument("--gpu", help="catalog slug of the GPU this runs on, e.g. h200-141gb (default: the plan's GPU)")
    ap.add_argument("--torchtitan-config", help="torchtitan TOML for the same model shape")
    ap.add_argument("--tiny", action="store_true", help="CPU wiring check: tiny model, 2 processes")
    ap.add_argument("--float8", action="store_true",
                    help="also run the trainer with efficiency.float8 and print the measured float8/bf16 "
                         "tokens/s ratio beside the planner's (catalog/data/throughput.yaml float8)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.gpus, args.seq_len, args.micro_batch, args.steps = 2, 32, 2, 6
    with tempfile.TemporaryDirectory(prefix="gpuprov-mfu-") as work:
        plan, launch = render_launch_dir(args.model, args.task, Path(work))
        from gpuprov.catalog.gpus import get_gpu

        peak = args.peak_tflops or get_gpu(args.gpu or plan.gpu.slug).bf16_tflops
        ours = run_trainer(launch, Path(work), args, peak)
        fp8 = run_trainer(launch, Path(work), args, peak, float8=True) if args.float8 and not args.tiny else None
    if args.tiny and "error" not in ours:
        ours["mfu"] = None  # the plan's FLOPs per token are the full model's, not the tiny shape's
    theirs = run_torchtitan(args) if not args.tiny else {"error": "skipped with --tiny"}
    predicted = predicted_peak(plan, args)
    shape = (f"{args.model} {args.task}, {args.gpus} GPU(s), seq {args.seq_len} x micro-batch "
             f"{args.micro_batch}, AC {args.ac}")
    print(f"# {shape}{' (tiny CPU shape)' if args.tiny else ''}")
    print(f"{'trainer':<12} {'tokens/s':>12} {'MFU %':>7} {'peak GiB':>9} {'predicted GiB':>14}")
    pred = "n/a" if predicted is None else f"{predicted / GiB:.2f}"
    for name, row in (("gpuprov", ours), ("torchtitan", theirs)):
        print(f"{name:<12} {fmt(row, 'tokens_per_s'):>12} {fmt(row, 'mfu', 100, '.1f'):>7} "
              f"{fmt(row, 'peak_bytes', 1 / GiB, '.2f'):>9} {pred if name == 'gpuprov' else '':>14}")
    if "error" not in ours and "error" not in theirs:
        print(f"{'ratio':<12} {ours['tokens_per_s'] / theirs['tokens_per_s']:>12.2f} "
              f"{ours['mfu'] / theirs['mfu']:>7.2f} {(ours['peak_bytes'] or 0) / theirs['peak_bytes']:>9.2f}")
    for name, row in (("gpuprov", ours), ("torchtitan", theirs)):
        if "error" in row:
            print(f"{name}: {row['error'].strip().splitlines()[-1] if row['error'].strip() else 'failed'}")
    if fp8 is not None:
        print_float8(plan, args, ours, fp8)
    return 1 if "error" in ours else 0


def print_float8(plan, args, bf16: dict, fp8: dict) -> None:
    """Measured float8 / bf16 tokens/s of the same trainer and shape, beside the gain the planner uses."""
    from gpuprov.catalog.gpus import get_gpu
    from gpuprov.catalog.models import get_model
    from gpuprov.sizing.throughput import float8_gain

    found = float8_gain(get_gpu(args.gpu or plan.gpu.slug), get_model(args.model).params)
    planned = f"x{found[0]:.2f}" if found else "none (no measurement for this GPU class)"
    if "error" in fp8 or "error" in bf16:
        print(f"float8: {(fp8.get('error') or bf16.get('error') or 'failed').strip().splitlines()[-1]}")
        return
    print(f"float8: {fp8['tokens_per_s']:,.0f} tokens/s, peak {fp8['peak_bytes'] / GiB:.2f} GiB; "
          f"measured float8/bf16 x{fp8['tokens_per_s'] / bf16['tokens_per_s']:.2f}, planner {planned}")


if __name__ == "__main__":
    sys.exit(main())
