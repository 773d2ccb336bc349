"""`gpuprov estimate`: per-GPU peak memory of one training setup, term by term."""

from __future__ import annotations

import json

import click

from gpuprov.errors import GpuprovError
from gpuprov.sizing.types import AC_MODES, OFFLOADS, OPTIMIZERS, PRECISIONS, SHARDINGS, TASKS, TrainSetup

GIB = 2**30


def build_setup(
    *, task, seq_len, micro_batch, gpus, gpus_per_node, sharding, shard_group, activation_checkpointing,
    precision, optimizer, offload, lora_rank, lora_targets, compile, chunked_cross_entropy,
    grad_accumulation=1, activation_offloading=False, optimizer_impl="fused", loss_impl="hf", lora_dropout=0.0,
    qlora_base="sharded", tp=1, cp=1, pp=1,
) -> TrainSetup:
    from gpuprov.sizing.arch import resolve_lora_targets
    from gpuprov.sizing.memory import ExtendedSetup

    for flag, value in (("--seq-len", seq_len), ("--micro-batch", micro_batch), ("--gpus", gpus),
                        ("--lora-rank", lora_rank), ("--grad-accumulation", grad_accumulation)):
        if value <= 0:
            raise GpuprovError(f"{flag} must be a positive integer, got {value}")
    if gpus_per_node is None:
        gpus_per_node = min(8, gpus)
    if gpus_per_node <= 0:
        raise GpuprovError(f"--gpus-per-node must be a positive integer, got {gpus_per_node}")
    for flag, value in (("--tp", tp), ("--cp", cp), ("--pp", pp)):
        if value <= 0:
            raise GpuprovError(f"{flag} must be a positive integer, got {value}")
    if sharding is None:
        sharding = "none" if gpus == 1 else "fsdp"  # TP/CP/PP run under FSDP2 even on one data-parallel rank
    if shard_group is not None and sharding != "hsdp":
        raise GpuprovError("--shard-group applies to --sharding hsdp only")
    if not 0.0 <= lora_dropout < 1.0:
        raise GpuprovError(f"--lora-dropout must be in [0, 1), got {lora_dropout}")
    targets = resolve_lora_targets(lora_targets)
    return ExtendedSetup(
        task=task, seq_len=seq_len, micro_batch=micro_batch, gpus=gpus, gpus_per_node=gpus_per_node,
        sharding=sharding, shard_group=shard_group, activation_checkpointing=activation_checkpointing,
        precision=precision, optimizer=optimizer, offload=offload, lora_rank=lora_rank, lora_targets=targets,
        compile=compile, chunked_cross_entropy=chunked_cross_entropy, grad_accumulation_steps=grad_accumulation,
        activation_offloading=activation_offloading, optimizer_impl=optimizer_impl, loss_impl=loss_impl,
        lora_dropout=lora_dropout, qlora_base_replicated=(qlora_base == "replicated"), tp=tp, cp=cp, pp=pp,
    )


def _progress(stage: str, fraction: float) -> None:
    """Plain lines when stderr is a file or pipe; on a terminal one line that rewrites itself."""
    import sys

    line = f"[{fraction:4.0%}] {stage}"
    if not sys.stderr.isatty():
        click.echo(line, err=True)
        return
    width = 100
    click.echo("\r" + line[:width].ljust(width), err=True, nl=fraction >= 1.0)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 100 else f"{seconds / 60:.1f} min"


def _announced(progress, seconds: float):
    """`progress`, preceded once by the up-front time estimate when the simulation starts.

    Printed from the first progress report (after the input and the torch install are checked),
    so a bad flag or a missing extra is one error line, not a time estimate followed by an error.
    """
    pending = [True]

    def report(stage: str, fraction: float) -> None:
        if pending:
            pending.clear()
            click.echo(f"precise: simulating one training step on fake tensors; expect about "
                       f"{_duration(seconds)} (a rough guess: +-50% on a busy CPU)", err=True)
        progress(stage, fraction)

    return report


def run_precise(arch, setup, gpu_memory_bytes):
    """Lazily import the PyTorch-backed estimator with a clear install hint."""
    try:
        from gpuprov.sizing.precise import estimate_precise, estimate_seconds
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in ("torch", "transformers"):
            raise GpuprovError("--precise needs PyTorch and transformers: pip install 'gpuprov[precise]'") from None
        raise
    try:
        # before the call: estimate_seconds counts the import of transformers while it is still to come
        progress = _announced(_progress, estimate_seconds(arch, setup))
        return estimate_precise(arch, setup, gpu_memory_bytes, progress=progress)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in ("torch", "transformers"):
            raise GpuprovError("--precise needs PyTorch and transformers: pip install 'gpuprov[precise]'") from None
        raise


def result_dict(arch, gpu, setup, est, estimator: str) -> dict:
    from gpuprov.sizing.memory import allocator_bytes

    return {
        "per_gpu_bytes": est.per_gpu_bytes,
        "breakdown": dict(est.breakdown),
        "fits": est.per_gpu_bytes <= gpu.memory_bytes,
        "gpu_memory_bytes": gpu.memory_bytes,
        "headroom_bytes": gpu.memory_bytes - est.per_gpu_bytes,
        "allocator": allocator_bytes(est, gpu.memory_bytes),
        "model_states_bytes": est.model_states_bytes,
        "model": {
            "name": arch.name,
            "display_name": arch.display_name,
            "model_type": arch.model_type,
            "params": arch.params,
            "trainable_params": est.trainable_params,
        },
        "gpu": {"slug": gpu.slug, "name": gpu.name},
        "setup": {
            "task": setup.task, "seq_len": setup.seq_len, "micro_batch": setup.micro_batch, "gpus": setup.gpus,
            "gpus_per_node": setup.gpus_per_node, "sharding": setup.sharding, "shard_group": setup.shard_group,
            "activation_checkpointing": setup.activation_checkpointing, "precision": setup.precision,
            "optimizer": setup.optimizer, "offload": setup.offload,
            "lora_rank": setup.lora_rank if setup.task != "full" else None,
            "lora_targets": list(setup.lora_targets) if setup.task != "full" else None,
            "compile": setup.compile, "chunked_cross_entropy": setup.chunked_cross_entropy,
            "grad_accumulation": getattr(setup, "grad_accumulation_steps", 1),
            "activation_offloading": getattr(setup, "activation_offloading", False),
            "optimizer_impl": getattr(setup, "optimizer_impl", "fused"),
            "loss_impl": getattr(setup, "loss_impl", "hf"),
            "lora_dropout": getattr(setup, "lora_dropout", 0.0),
            "tp": setup.tp, "cp": setup.cp, "pp": setup.pp,
        },
        "estimator": estimator,
        "assumptions": list(est.assumptions),
    }


def _what_would_fit(d: dict) -> str:
    """A pointer, not a search: GPUs that hold this peak, and the knob most likely to shrink it."""
    from gpuprov.catalog.gpus import list_gpus

    s = d["setup"]
    bigger = [g.slug for g in sorted(list_gpus(), key=lambda g: g.memory_bytes) if g.memory_bytes >= d["per_gpu_bytes"]]
    bits = [f"GPUs that hold {d['per_gpu_bytes'] / GIB:,.1f} GiB: {', '.join(bigger[:4])}" if bigger
            else "no GPU in the catalog holds it as set up"]
    if s["activation_checkpointing"] != "full":
        bits.append("--activation-checkpointing full recomputes activations instead of keeping them")
    bits.append(f"`gpuprov plan --model ... --task {s['task']} --gpus N` searches sharding, recompute and micro-batch")
    return "what would make it fit: " + "; ".join(bits)


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "-" if value is None else str(value)


def render_table(d: dict) -> str:
    m, g, s = d["model"], d["gpu"], d["setup"]
    total = d["per_gpu_bytes"]
    lines = [
        f"{m['display_name']} ({m['params']:,} params, {m['trainable_params']:,} trainable) - {s['task']}"
        f" on {s['gpus']} x {g['name']}",
        f"seq-len {s['seq_len']}, micro-batch {s['micro_batch']}, {s['sharding']}, AC {s['activation_checkpointing']},"
        f" {s['precision']}, {s['optimizer']}, offload {s['offload']}"
        + (f", tp {s['tp']} cp {s['cp']} pp {s['pp']}" if s["tp"] * s["cp"] * s["pp"] > 1 else "")
        + f"  [{d['estimator']} estimate]",
    ]
    if d.get("defaults"):
        lines.append("defaults used (not given): " + ", ".join(
            f"{k} {_shown(v)}" for k, v in d["defaults"].items()))
    side = d.get("analytic")
    lines += ["", f"{'term':<28}{'GiB':>10}{'share':>8}" + (f"{'analytic GiB':>14}" if side else "")]
    for term in dict.fromkeys([*d["breakdown"], *(side["breakdown"] if side else [])]):
        value = d["breakdown"].get(term, 0)
        other = side["breakdown"].get(term, 0) if side else 0
        if value or other:
            lines.append(f"{term:<28}{value / GIB:>10.2f}{value / total:>8.1%}"
                         + (f"{other / GIB:>14.2f}" if side else ""))
    lines.append(f"{'peak per GPU':<28}{total / GIB:>10.2f}" + (f"{side['per_gpu_bytes'] / GIB:>22.2f}" if side else ""))
    lines.append(f"{'GPU memory (usable)':<28}{d['gpu_memory_bytes'] / GIB:>10.2f}")
    head = d["headroom_bytes"] / GIB
    verdict = "FITS" if d["fits"] else "DOES NOT FIT"
    lines.append(f"{verdict}: headroom {head:+.2f} GiB ({d['headroom_bytes'] / d['gpu_memory_bytes']:+.1%} of the GPU)")
    if not d["fits"]:
        lines.append(_what_would_fit(d))
    lines.append("")
    lines.append("assumes:")
    lines.extend(f"  - {a}" for a in d["assumptions"])
    return "\n".join(lines)


@click.command(name="estimate")
@click.option("--model", "model_name", default="7b", show_default=True, help="Preset (see `gpuprov models`), Hugging Face id (ORG/NAME: local cache, else the hub) or config.json path.")
@click.option("--task", type=click.Choice(TASKS), default="full", show_default=True)
@click.option("--seq-len", type=int, default=4096, show_default=True, help="Tokens per sample.")
@click.option("--micro-batch", type=int, default=1, show_default=True, help="Samples per GPU per forward.")
@click.option("--gpu", "gpu_slug", default="h100-80gb", show_default=True, help="GPU slug (see `gpuprov gpus`).")
@click.option("--gpus", type=int, default=8, show_default=True, help="Total GPUs.")
@click.option("--gpus-per-node", type=int, default=None, help="GPUs per node (default: min(8, --gpus)).")
@click.option("--sharding", type=click.Choice(SHARDINGS), default=None, help="Default: none on 1 GPU, else fsdp.")
@click.option("--shard-group", type=int, default=None, help="hsdp shard-group size (default: GPUs of one node).")
@click.option("--activation-checkpointing", type=click.Choice(AC_MODES), default="selective", show_default=True)
@click.option("--precision", type=click.Choice(PRECISIONS), default="bf16-mixed", show_default=True)
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="adamw", show_default=True)
@click.option("--lora-rank", type=int, default=16, show_default=True)
@click.option("--lora-targets", default="all-linear", show_default=True, help="qv, attention, all-linear, or a comma list such as q_proj,v_proj.")
@click.option("--offload", type=click.Choice(OFFLOADS), default="none", show_default=True)
@click.option("--compile/--no-compile", "use_compile", default=False, show_default=True, help="torch.compile per block.")
@click.option("--chunked-cross-entropy/--no-chunked-cross-entropy", default=False, show_default=True)
@click.option("--grad-accumulation", type=int, default=1, show_default=True,
              help="Micro-batches per optimizer step (>1 keeps gradients through forward).")
@click.option("--activation-offloading", is_flag=True, help="Saved activations streamed to host memory.")
@click.option("--optimizer-impl", type=click.Choice(("fused", "foreach")), default="fused", show_default=True,
              help="AdamW kernel: foreach adds one state-sized temporary at the step.")
@click.option("--loss-impl", type=click.Choice(("hf", "hf-legacy", "native")), default="hf", show_default=True,
              help="Loss stack: hf (transformers >= 4.45, logits kept by the loop), hf-legacy (< 4.45, fp32 logits kept),"
                   " native (logits freed before backward, e.g. torchtitan/torchtune).")
@click.option("--lora-dropout", type=float, default=0.0, show_default=True,
              help="LoRA dropout probability (> 0 keeps a dropped-out input copy + mask per adapted module).")
@click.option("--qlora-base", type=click.Choice(("sharded", "replicated")), default="sharded", show_default=True,
              help="QLoRA NF4 base under FSDP: sharded (fsdp_qlora, accelerate with bnb_4bit_quant_storage) or "
                   "replicated on every GPU (gpuprov's trainer: FSDP2 cannot shard bitsandbytes weights).")
@click.option("--tp", type=int, default=1, show_default=True,
              help="Tensor-parallel degree (+ sequence parallelism); at most the GPUs of one node.")
@click.option("--cp", type=int, default=1, show_default=True, help="Context-parallel degree (ring attention).")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline stages (1F1B schedule).")
@click.option("--precise", is_flag=True, help="Measure with PyTorch on fake tensors (needs gpuprov[precise]).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def estimate(model_name, task, seq_len, micro_batch, gpu_slug, gpus, gpus_per_node, sharding, shard_group,
             activation_checkpointing, precision, optimizer, lora_rank, lora_targets, offload, use_compile,
             chunked_cross_entropy, grad_accumulation, activation_offloading, optimizer_impl, loss_impl,
             lora_dropout, qlora_base, tp, cp, pp, precise, as_json) -> None:
    """Per-GPU peak memory of one training setup, term by term, and whether it fits.

    \b
    gpuprov estimate --model llama-3.1-8b --gpu h100-80gb --gpus 8
    gpuprov estimate --model 70b --task qlora --gpu rtx-4090-24gb --gpus 2
    gpuprov estimate --model meta-llama/Llama-3.1-8B --task lora --gpus 1 --json
    gpuprov estimate --model 70b --gpus 64 --tp 8                    # TP 8 x FSDP 8
    gpuprov estimate --model 8b --gpus 8 --cp 4 --seq-len 131072     # context parallel 4
    """
    from gpuprov.catalog.gpus import get_gpu
    from gpuprov.catalog.models import get_model
    from gpuprov.sizing.memory import estimate_memory

    arch = get_model(model_name)
    gpu = get_gpu(gpu_slug)
    setup = build_setup(
        task=task, seq_len=seq_len, micro_batch=micro_batch, gpus=gpus, gpus_per_node=gpus_per_node,
        sharding=sharding, shard_group=shard_group, activation_checkpointing=activation_checkpointing,
        precision=precision, optimizer=optimizer, offload=offload, lora_rank=lora_rank, lora_targets=lora_targets,
        compile=use_compile, chunked_cross_entropy=chunked_cross_entropy, grad_accumulation=grad_accumulation,
        activation_offloading=activation_offloading, optimizer_impl=optimizer_impl, loss_impl=loss_impl,
        lora_dropout=lora_dropout, qlora_base=qlora_base, tp=tp, cp=cp, pp=pp,
    )
    if precise and tp * cp * pp > 1:
        raise GpuprovError("--precise simulates FSDP on one rank; it does not model --tp/--cp/--pp yet (drop --precise)")
    analytic = estimate_memory(arch, setup, gpu.memory_bytes)
    est, kind = (run_precise(arch, setup, gpu.memory_bytes), "precise") if precise else (analytic, "analytic")
    d = result_dict(arch, gpu, setup, est, kind)
    d["defaults"] = _defaults_used(gpus_per_node=setup.gpus_per_node, sharding=setup.sharding)
    if precise:
        d["analytic"] = {"per_gpu_bytes": analytic.per_gpu_bytes, "breakdown": dict(analytic.breakdown)}
    click.echo(json.dumps(d, indent=2) if as_json else render_table(d))


def _defaults_used(**resolved) -> dict:
    """Every option the user did not give, with the value used (derived ones as resolved)."""
    ctx = click.get_current_context()
    task, sharding = ctx.params.get("task"), resolved.get("sharding")
    unused = {"as_json", "precise"}
    if task == "full":
        unused |= {"lora_rank", "lora_targets", "lora_dropout"}
    if task != "qlora":
        unused.add("qlora_base")
    if sharding != "hsdp":
        unused.add("shard_group")
    out = {}
    for p in ctx.command.params:
        if p.name in unused or ctx.get_parameter_source(p.name) != click.core.ParameterSource.DEFAULT:
            continue
        flag = max(p.opts, key=len)
        value = resolved.get(p.name, ctx.params.get(p.name))
        out[flag] = value
    return out
