#!/usr/bin/env python3
"""The GPU day: gpuprov's trainer and pinned torchtitan side by side on one offline GPU.

    python benchmarks/gpu_day.py --prepare CARRY   # here (gpuprov + PyPI): CARRY/ <= 60 MiB
    python CARRY/gpu_day.py                        # on the GPU machine: offline, a recent torch + numpy
    python benchmarks/gpu_day.py --dry-run         # CPU, tiny shapes, the same code paths (the suite)

On one GPU, for "1b-full" (llama-3.2-1b, full training) and "8b-lora" (llama-3.1-8b, LoRA): the
shape gpuprov's planner fits to that GPU (its on-prem plan for one host with that GPU: micro-batch,
seq_len, activation checkpointing, compile, chunked loss), run for a few steps on synthetic tokens
with fresh weights (speed and memory do not depend on the values) by
  gpuprov     the bundle's launch/train.py under torchrun (train.yaml from the plan);
  torchtitan  pinned torchtitan 0.3.0's own llama3 model ("1B" ties embeddings as llama-3.2-1b does),
              LoRA / float8 converters, parallelize_llama (AC, per-block compile, FSDP2 mixed
              precision), loss, AdamW and clipping, driven by gpu_day_titan.py (which says exactly
              what of torchtitan runs and what it supplies), with the same AC, compile, chunked
              loss, float8, precision, optimizer and LoRA settings as gpuprov's side.
Printed per side: tokens/s (median after two warm-up steps), MFU against the measured GPU's
catalog bf16 peak and against a bf16 matmul measured here (the same FLOPs per token on both
sides), peak reserved and allocated memory; gpuprov's predicted peak and tokens/s beside them; the
float8/bf16 tokens/s ratio per side where torchao is installed (its kernels must match the
installed torch, so it is not carried; torchtitan 0.3.0 offers only rowwise float8 recipes,
gpuprov's trainer uses tensorwise). torchtitan 0.3.0 needs torch >= 2.11 (its spmd_types pin);
on an older torch its rows say the import error.
--prepare carries: the trainer's files, the plans' numbers (cases.json), torchtitan and the four
pure-Python packages its training path imports (titan/), and wheels of transformers, peft,
safetensors, PyYAML and their dependencies (--no-deps on torch / numpy).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GiB, MiB = 2**30, 2**20
CASES = {"1b-full": ("llama-3.2-1b", "full"), "8b-lora": ("llama-3.1-8b", "lora")}
GPUS = ("h100-80gb", "h100-pcie-80gb", "h200-141gb", "b200-180gb", "a100-80gb", "a100-40gb", "l40s-48gb")
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": False}
# carried with their dependencies (pins: the versions this suite runs); torch and numpy are the machine's
WITH_DEPS = ("transformers", "safetensors", "pyyaml")
NO_DEPS = ("peft", "accelerate", "psutil")  # peft's own requirements would pull torch
MACHINE_HAS = ("numpy", "torch")
CARRY_LIMIT = 60 * MiB
HERE = Path(__file__).resolve().parent
# torchtitan's wheels for the dry run and --prepare (.ci/setup.d fills it; else pip downloads them once)
CACHE = Path(os.environ.get("GPU_DAY_CACHE", HERE.parent / ".cache" / "gpu-day"))


# ------------------------------------------------------------------------------ prepare (here)

def plan_cases() -> dict:
    """gpuprov's plan per case and GPU: the fitted shape, train.yaml and the predictions."""
    import yaml

    from gpuprov.planner import make_plan
    from gpuprov.render.launch import render_launch
    from gpuprov.spec import HostEntry, TrainingSpec

    out: dict = {}
    for case, (model, task) in CASES.items():
        out[case] = {}
        for gpu in GPUS:
            plan = make_plan(TrainingSpec(model=model, task=task, cloud="onprem", tokens=10**8, gpu_count=1,
                                          hosts=[HostEntry(name="gpu0", address="10.0.0.1", gpu=gpu, gpus=1)]))
            out[case][gpu] = {"gpu_name": plan.gpu.name, "memory_bytes": plan.gpu.memory_bytes,
                              "bf16_tflops": plan.gpu.bf16_tflops,
                              "predicted_peak_bytes": plan.memory.per_gpu_bytes,
                              "predicted_tokens_per_s": plan.throughput.tokens_per_s,
                              "train_yaml": yaml.safe_load(render_launch(plan)["train.yaml"])}
    return out


def fetch_titan() -> list[Path]:
    """Pinned torchtitan and the pure-Python packages its training path imports, from the cache (PyPI once)."""
    from gpu_day_titan import PINS

    names = {p.split("==")[0].replace("-", "_").lower() for p in PINS}
    pinned = lambda: [w for w in CACHE.glob("*.whl") if w.name.split("-")[0].lower() in names]  # noqa: E731
    if len(pinned()) < len(PINS):
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "-d", str(CACHE), *PINS], check=True)
    return pinned()


def titan_wheels(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for wheel in fetch_titan():
        shutil.copy(wheel, dest / wheel.name)


def prepare(carry: Path, wheels: bool, python_versions: list[str]) -> None:
    carry.mkdir(parents=True, exist_ok=True)
    (carry / "cases.json").write_text(json.dumps(plan_cases(), indent=1))
    launch = carry / "launch"
    launch.mkdir(exist_ok=True)
    for f in (HERE.parent / "templates" / "launch").glob("*.py"):
        shutil.copy(f, launch / f.name)
    shutil.copy(__file__, carry / "gpu_day.py")
    shutil.copy(HERE / "gpu_day_titan.py", carry / "gpu_day_titan.py")
    if wheels:
        from importlib.metadata import version

        titan_wheels(carry / "titan")

        for py in python_versions:
            common = ["--quiet", "--only-binary=:all:", "--python-version", py, "--platform", "manylinux2014_x86_64",
                      "--platform", "manylinux_2_28_x86_64", "-d", str(carry / "wheels")]
            for names, deps in ((WITH_DEPS, []), (NO_DEPS, ["--no-deps"])):
                pins = [f"{n}=={version(n)}" for n in names]
                subprocess.run([sys.executable, "-m", "pip", "download", *common, *deps, *pins], check=True)
        for wheel in (carry / "wheels").glob("*.whl"):
            if wheel.name.split("-")[0].lower() in MACHINE_HAS:
                wheel.unlink()
    size = sum(f.stat().st_size for f in carry.rglob("*") if f.is_file())
    print(f"gpu_day: {carry} holds {size / MiB:.1f} MiB (limit {CARRY_LIMIT / MiB:.0f})")
    if size > CARRY_LIMIT:
        raise SystemExit(f"gpu_day: {carry} is over {CARRY_LIMIT / MiB:.0f} MiB")


# ------------------------------------------------------------------------------ run (the GPU machine)

def ensure_packages(carry: Path) -> dict:
    """transformers & co. from the carried wheels when the machine lacks them: the env for children."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
        import yaml  # noqa: F401
        return env
    except ImportError:
        pass
    site = carry / "site"
    if not site.is_dir():
        # --no-deps: the wheels are the whole closure but torch and numpy, which the machine has
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target",
                        str(site), *map(str, sorted((carry / "wheels").glob("*.whl")))], check=True)
    sys.path.insert(0, str(site))
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    return env


def pick_gpu(entries: dict, dry: bool) -> str:
    """The catalog GPU this machine is: by name, else the one with the nearest memory."""
    if dry:
        return next(iter(entries))
    import torch

    name, total = torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory
    key = name.lower().replace("nvidia", "").split()
    for gpu, e in entries.items():
        if all(k in e["gpu_name"].lower() for k in key[:2]):
            return gpu
    return min(entries, key=lambda g: abs(entries[g]["memory_bytes"] - total))


def shaped(entry: dict, dry: bool, steps: int, work: Path, float8: bool = False) -> dict:
    """train.yaml for a short benchmark run of the plan's shape (a tiny one with --dry-run)."""
    cfg = json.loads(json.dumps(entry["train_yaml"]))
    cfg["model"].update(init="random", pretrained_path=None)
    cfg["batch"]["grad_accum"] = 1
    cfg["schedule"].update(steps=steps, warmup_steps=1)
    cfg["data"].update(path=None, synthetic=True, synthetic_samples=None)
    cfg["data"]["validation"]["every_steps"] = 0
    cfg["checkpoint"].update(dir=str(work / "ckpt"), every_steps=0)
    cfg["logging"].update(every_steps=1, metrics_file=str(work / "metrics.jsonl"), tensorboard_dir=None)
    cfg["export"]["at_end"] = False
    cfg["runtime"].update(flight_recorder_entries=0, flight_recorder_dir=None, gc_every_steps=0)
    cfg["efficiency"]["float8"] = float8
    if dry:
        cfg["model"]["hf_config"] = dict(TINY)
        cfg["batch"].update(seq_len=64, micro_batch=2)
        cfg["runtime"]["device"] = "cpu"
        cfg["precision"].update(param_dtype="float32", tf32=False)
        cfg["mfu"]["plan_seq_len"] = 64
    return cfg


def median_after_warmup(values: list[float]) -> float | None:
    return statistics.median(values[2:] or values) if values else None


def failure(text: str) -> str:
    """The line that says why a child failed (the trainer's one-line error, or the exception)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    hits = [ln for ln in lines if (ln.startswith("train.py:") or "Error:" in ln) and "ChildFailedError" not in ln]
    return (hits or lines or ["no output"])[-1][:300]


def run_gpuprov(carry: Path, cfg: dict, env: dict, work: Path, timeout: float) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    import yaml

    (work / "train.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(carry / "launch" / "train.py"), "--config", str(work / "train.yaml")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        return {"error": failure(out.stdout + out.stderr)}
    recs = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    end = next(r for r in recs if r.get("event") == "end")
    return {"tokens_per_s": median_after_warmup([r["tokens_per_s"] for r in recs if "loss" in r]),
            "reserved": end["peak_memory_reserved_bytes"], "allocated": end["peak_memory_allocated_bytes"]}


def titan_site(carry: Path, work: Path) -> Path:
    """The carried torchtitan wheels unpacked (pure-Python wheels: unzipping is installing them)."""
    import zipfile

    site = work / "titan-site"
    if not site.is_dir():
        for wheel in sorted((carry / "titan").glob("*.whl")):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(site)
    return site


def run_titan(carry: Path, cfg: dict, env: dict, work: Path, site: Path, timeout: float) -> dict:
    """gpu_day_titan.py in one process (rank 0 of 1): pinned torchtitan's components on the same shape."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "titan.json").write_text(json.dumps(cfg))
    port = free_port()
    child = dict(env, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(carry / "gpu_day_titan.py"), str(work / "titan.json")], env=child,
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        return {"error": failure(out.stdout + out.stderr)}
    return json.loads(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measured_matmul_tflops() -> float | None:
    """A bf16 8192^3 matmul's rate here: the peak this GPU reaches, beside its catalog figure."""
    import torch

    if not torch.cuda.is_available():
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t, n = time.perf_counter(), 20
    for _ in range(n):
        a @ a
    torch.cuda.synchronize()
    return 2 * 8192**3 * n / (time.perf_counter() - t) / 1e12


def float8_reason() -> str | None:
    """Why float8 cannot run here, or None."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        return "needs an sm_89+ GPU"
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "torchao not installed (not carried: its kernels must match the installed torch)"
    return None


def row(side: str, case: str, cfg: dict, r: dict, entry: dict, peak: float | None) -> str:
    if "error" in r:
        return f"{side:<10} {case:<8} error: {r['error']}"
    b = cfg["batch"]
    hf = cfg["model"]["hf_config"]
    fpt = float(cfg["mfu"]["flops_per_token"]) if hf != TINY else 6 * 2 * hf["hidden_size"] ** 2 * 12 * hf["num_hidden_layers"]
    tps = r["tokens_per_s"]
    mfu = tps * fpt / (entry["bf16_tflops"] * 1e12)
    mfu_meas = f"{100 * tps * fpt / (peak * 1e12):5.1f}%" if peak else "  n/a"
    gib = lambda v: f"{v / GiB:7.2f}" if v else "    n/a"  # noqa: E731
    return (f"{side:<10} {case:<8} mb {b['micro_batch']} x seq {b['seq_len']:<5} AC {cfg['parallel']['activation_checkpointing']:<9} "
            f"{tps:>10,.0f} tok/s  MFU {100 * mfu:5.1f}% (catalog) {mfu_meas} (measured)  "
            f"peak {gib(r['reserved'])} / {gib(r['allocated'])} GiB reserved / allocated"
            + (f"  (llama3 {r['flavour']})" if r.get("flavour") else ""))


def float8_line(case: str, reason: str | None, pairs: list[tuple[str, dict, dict | None]]) -> str:
    """float8/bf16 tokens/s per side, or why not."""
    if reason:
        return f"float8/bf16 {case}: n/a ({reason})"
    parts = []
    for side, bf16, fp8 in pairs:
        bad = (fp8 or {}).get("error") or bf16.get("error")
        ratio = None if bad or not fp8 else fp8["tokens_per_s"] / bf16["tokens_per_s"]
        parts.append(f"{side} n/a ({bad})" if ratio is None else f"{side} {ratio:.2f}x")
    return f"float8/bf16 {case}: " + "; ".join(parts) + " tokens/s"


def run_case(carry: Path, case: str, entry: dict, dry: bool, steps: int, env: dict, peak: float | None,
             deadline: float) -> list[str]:
    """One case: gpuprov's trainer and torchtitan on the same shape (and in float8 where it can run)."""
    left = lambda: max(30.0, min(190.0, deadline - time.perf_counter()))  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        site = titan_site(carry, work)
        cfg = shaped(entry, dry, steps, work / "ours")
        ours = run_gpuprov(carry, cfg, env, work / "ours", left())
        titan = run_titan(carry, cfg, env, work / "titan", site, left())
        reason = "dry run (CPU)" if dry else float8_reason()
        pairs = [("gpuprov", ours, None), ("torchtitan", titan, None)]
        if reason is None:
            cfg8 = shaped(entry, dry, steps, work / "fp8", True)
            pairs = [("gpuprov", ours, run_gpuprov(carry, cfg8, env, work / "fp8", left())),
                     ("torchtitan", titan, run_titan(carry, cfg8, env, work / "titan8", site, left()))]
    where = "cpu (dry run, tiny shape)" if dry else entry["gpu_name"]
    return [f"{case} on {where}:",
            row("gpuprov", case, cfg, ours, entry, peak),
            row("torchtitan", case, cfg, titan, entry, peak),
            f"predicted  {case:<8} {entry['predicted_tokens_per_s']:>10,.0f} tok/s  peak "
            f"{entry['predicted_peak_bytes'] / GiB:7.2f} GiB (gpuprov's plan for the full shape)",
            float8_line(case, reason, pairs)]


def run(carry: Path, dry: bool, steps: int) -> int:
    env = ensure_packages(carry)
    cases = json.loads((carry / "cases.json").read_text())
    peak = None if dry else measured_matmul_tflops()
    t0 = time.perf_counter()
    deadline = t0 + 450.0  # the whole day stays under 8 minutes
    lines = []
    for case, entries in cases.items():
        lines += run_case(carry, case, entries[pick_gpu(entries, dry)], dry, steps, env, peak, deadline)
    print("\n".join(lines))
    print(f"measured bf16 matmul peak: {f'{peak:.0f} TFLOP/s' if peak else 'n/a'}; "
          f"wall {time.perf_counter() - t0:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare", metavar="CARRY", help="write the carry folder (here, with gpuprov and PyPI)")
    ap.add_argument("--no-wheels", action="store_true", help="with --prepare: skip the wheel download")
    ap.add_argument("--python", action="append", default=None, help="target Python versions for wheels (3.12)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: both sides, the same code paths")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 12; dry run 4)")
    args = ap.parse_args(argv)
    if args.prepare:
        prepare(Path(args.prepare), not args.no_wheels, args.python or ["3.12"])
        return 0
    steps = args.steps or (4 if args.dry_run else 12)
    carry = HERE
    if args.dry_run and not (HERE / "cases.json").is_file():
        with tempfile.TemporaryDirectory() as tmp:
            prepare(Path(tmp), wheels=False, python_versions=[])
            titan_wheels(Path(tmp) / "titan")
            return run(Path(tmp), True, steps)
    return run(carry, args.dry_run, steps)


if __name__ == "__main__":
    sys.exit(main())
