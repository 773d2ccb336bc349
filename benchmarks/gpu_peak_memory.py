#!/usr/bin/env python3
"""Measured peak GPU memory, tokens/s and MFU of the generated trainer next to `gpuprov estimate`.

On a machine with one CUDA GPU (and gpuprov installed with the `train` extra):

    python benchmarks/gpu_peak_memory.py [--gpu h200-141gb] [--steps 8] [--only NAME] \
        [--out benchmarks/gpu_peak_memory_results.yaml]

For each case it renders a real bundle's launch/ folder from a gpuprov plan, shrinks the run to
one GPU with train.py's --set overrides (the settings below), runs launch/train.sh for a few steps
on synthetic data with fresh weights built from the model's config (no download: memory and speed
do not depend on the weight values), and writes one row per case: the estimate's per-GPU bytes
and terms, the trainer's measured torch.cuda.max_memory_reserved / max_memory_allocated, the
median tokens/s after warm-up and the MFU by the planner's formula. Rows mirror the fields of
shared/reference/measured-peaks.yaml so the comparison can read them. Refuses without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GiB = 2**30

# name: (model, task, seq_len, micro_batch, activation checkpointing, lora targets)
CASES = {
    "1b-full-sac": ("llama-3.2-1b", "full", 4096, 2, "selective", None),
    "1b-full-noac": ("llama-3.2-1b", "full", 4096, 1, "none", None),
    "1b-full-fullac": ("llama-3.2-1b", "full", 4096, 4, "full", None),
    "3b-full-sac": ("llama-3.2-3b", "full", 4096, 1, "selective", None),
    "8b-lora-fullac": ("llama-3.1-8b", "lora", 4096, 2, "full", "all-linear"),
}


def refuse_without_cuda() -> None:
    try:
        import torch
    except ImportError:
        sys.exit("gpu_peak_memory.py: PyTorch is not installed (pip install 'gpuprov[train]')")
    if not torch.cuda.is_available():
        sys.exit("gpu_peak_memory.py: needs a CUDA GPU: it measures real peak GPU memory, "
                 "which a CPU run cannot (nothing was run)")


def estimate(model: str, task: str, seq_len: int, micro_batch: int, ac: str, gpu: str, targets: str | None) -> dict:
    cmd = [sys.executable, "-m", "gpuprov", "estimate", "--json", "--model", model, "--task", task,
           "--seq-len", str(seq_len), "--micro-batch", str(micro_batch), "--gpu", gpu, "--gpus", "1",
           "--gpus-per-node", "1", "--sharding", "fsdp", "--activation-checkpointing", ac,
           "--precision", "bf16-mixed", "--optimizer", "adamw"]
    if targets:
        cmd += ["--lora-targets", targets]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def render_bundle(model: str, task: str, seq_len: int, gpu: str, root: Path) -> Path:
    """launch/ exactly as `gpuprov generate` writes it, from a real plan for this model."""
    from gpuprov.planner import make_plan
    from gpuprov.render.launch import render_launch
    from gpuprov.spec import TrainingSpec

    plan = make_plan(TrainingSpec(model=model, task=task, seq_len=seq_len, cloud="aws", gpus=[gpu],
                                  tokens=10**9))
    launch = root / "launch"
    launch.mkdir(parents=True)
    for name, text in render_launch(plan).items():
        (launch / name).write_text(text)
        if name.endswith((".sh", ".sbatch")):
            (launch / name).chmod(0o755)
    return launch


def run_case(name: str, gpu: str, steps: int, work: Path) -> dict:
    from gpuprov.catalog.gpus import get_gpu

    model, task, seq_len, micro, ac, targets = CASES[name]
    spec = get_gpu(gpu)
    est = estimate(model, task, seq_len, micro, ac, gpu, targets)
    root = work / name
    launch = render_bundle(model, task, seq_len, gpu, root)
    metrics = root / "metrics.jsonl"
    sets = {
        "parallel.sharding": "fsdp", "parallel.replicate": 1, "parallel.shard": 1,
        "parallel.activation_checkpointing": ac, "parallel.offload": "none",
        "batch.micro_batch": micro, "batch.grad_accum": 1, "batch.seq_len": seq_len,
        "schedule.steps": steps, "schedule.warmup_steps": 2, "checkpoint.every_steps": 0,
        "checkpoint.dir": str(root / "ckpt"), "logging.every_steps": 1, "logging.metrics_file": str(metrics),
        "mfu.peak_tflops_per_gpu": spec.bf16_tflops, "data.path": None, "data.synthetic": True,
        "model.init": "random", "model.pretrained_path": None, "export.at_end": False, "runtime.device": "cuda",
        "efficiency.compile": False,  # the rows say compile: False, as `gpuprov estimate` sizes them
        "optimizer.name": "adamw",
    }
    if task != "full":
        sets["task.lora.targets"] = targets
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    env = dict(os.environ, PYTHON=sys.executable, GPUPROV_NNODES="1", GPUPROV_NPROC_PER_NODE="1",
               GPUPROV_INVENTORY=str(root / "none.yml"), HF_HUB_OFFLINE="1")
    t0 = time.time()
    proc = subprocess.run(["bash", str(launch / "train.sh"), *args], env=env, capture_output=True, text=True)
    wall = time.time() - t0
    row = {"id": f"gpuprov-trainer-{name}", "model": model, "task": task, "seq_len": seq_len, "micro_batch": micro,
           "gpu": spec.name, "gpus": 1, "sharding": "fsdp", "activation_checkpointing": ac,
           "precision": "bf16-mixed", "optimizer": "adamw", "compile": False, "steps": steps,
           "estimate_per_gpu_bytes": est["per_gpu_bytes"], "estimate_breakdown": est["breakdown"],
           "estimate_allocator": est.get("allocator"), "wall_s": round(wall, 1)}
    if proc.returncode != 0:
        row["error"] = (proc.stdout + proc.stderr)[-3000:]
        return row
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    step_recs = [r for r in records if "loss" in r]
    end = next(r for r in records if r.get("event") == "end")
    steady = step_recs[2:] or step_recs  # the first steps include allocator and kernel warm-up
    reserved, allocated = end["peak_memory_reserved_bytes"], end["peak_memory_allocated_bytes"]
    row.update({
        "measured_reserved_bytes": reserved, "measured_allocated_bytes": allocated,
        "measured_reserved_gib": round(reserved / GiB, 2), "measured_allocated_gib": round(allocated / GiB, 2),
        "estimate_gib": round(est["per_gpu_bytes"] / GiB, 2),
        "estimate_over_reserved": round(est["per_gpu_bytes"] / reserved, 3),
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in steady), 1),
        "mfu": round(statistics.median(r["mfu"] for r in steady), 4),
        "loss_first": step_recs[0]["loss"], "loss_last": step_recs[-1]["loss"],
        "source": "benchmarks/gpu_peak_memory.py: gpuprov's generated launch/train.sh on one GPU, synthetic data",
    })
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="h200-141gb", help="gpuprov GPU slug of this machine's GPU")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--only", action="append", choices=sorted(CASES), help="run only these cases")
    ap.add_argument("--out", default=str(Path(__file__).with_name("gpu_peak_memory_results.yaml")))
    args = ap.parse_args()
    refuse_without_cuda()
    import torch
    from ruamel.yaml import YAML

    rows = []
    with tempfile.TemporaryDirectory(prefix="gpuprov-bench-") as work:
        for name in args.only or CASES:
            row = run_case(name, args.gpu, args.steps, Path(work))
            rows.append(row)
            if "error" in row:
                print(f"{name}: FAILED\n{row['error']}", flush=True)
            else:
                print(f"{name}: measured {row['measured_reserved_gib']} GiB reserved "
                      f"({row['measured_allocated_gib']} allocated), estimate {row['estimate_gib']} GiB, "
                      f"{row['tokens_per_s']:,.0f} tokens/s, MFU {100 * row['mfu']:.1f}%", flush=True)
    doc = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "rows": rows}
    yaml = YAML()
    yaml.default_flow_style = False
    with open(args.out, "w") as f:
        yaml.dump(doc, f)
    print(f"wrote {args.out}")
    sys.exit(1 if any("error" in r for r in rows) else 0)


if __name__ == "__main__":
    main()
