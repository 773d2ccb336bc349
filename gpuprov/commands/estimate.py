"""`gpuprov estimate`: per-GPU peak memory of one training setup, term by term."""

from __future__ import annotations

import json
import shlex
import sys

import click

from gpuprov.catalog.gpus import accelerator_name, get_gpu, list_gpus
from gpuprov.catalog.models import get_model
from gpuprov.commands.spec_options import setting_option
from gpuprov.errors import GpuprovError
from gpuprov.render.escape import shell_word
from gpuprov.sizing.frameworks import names, title
from gpuprov.sizing.memory import allocator_bytes, estimate_memory
from gpuprov.sizing.setup import setup_from_options
from gpuprov.sizing.suggest import flags_of
from gpuprov.sizing.suggest import suggest as find
from gpuprov.sizing.types import (
    COMPILE_SCOPES, LOSS_IMPL_NAMES, OFFLOADS, OPTIMIZER_IMPLS, OPTIMIZERS, PP_SCHEDULES, PRECISIONS, SHARDINGS,
    TASKS,
)
from gpuprov.sizing.why import notes as why_notes
from gpuprov.units import GiB as GIB

PRECISE_HINT = ("--precise needs PyTorch and transformers: pip install torch transformers peft "
                "(the [precise] extra of a gpuprov checkout)")


def _progress(stage: str, fraction: float) -> None:
    """Plain lines when stderr is a file or pipe; on a terminal one line that rewrites itself."""
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
            raise GpuprovError(PRECISE_HINT) from None
        raise
    try:
        # before the call: estimate_seconds counts the import of transformers while it is still to come
        progress = _announced(_progress, estimate_seconds(arch, setup))
        return estimate_precise(arch, setup, gpu_memory_bytes, progress=progress)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in ("torch", "transformers"):
            raise GpuprovError(PRECISE_HINT) from None
        raise


def _gpu_count_from_name(ctx: click.Context, gpu_slug: str) -> dict:
    """`--gpu H100:8` names the GPU count too (SkyPilot's form): it is --gpus, and a different
    explicit --gpus is a conflict, refused in one line."""
    params = dict(ctx.params)
    named = accelerator_name(gpu_slug)
    if named is None or named[1] is None:
        return params
    if ctx.get_parameter_source("gpus") == click.core.ParameterSource.COMMANDLINE and params["gpus"] != named[1]:
        raise GpuprovError(f"--gpu {gpu_slug} asks for {named[1]} GPUs but --gpus {params['gpus']}; give one count")
    params["gpus"] = named[1]
    return params


def result_dict(arch, gpu, setup, est, estimator: str) -> dict:
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
            "qlora_base": ("replicated" if setup.qlora_base_replicated else "sharded") if setup.task == "qlora" else None,
            "fsdp_version": setup.fsdp_version, "autocast_fp32_params": setup.autocast_fp32_params,
            "compile_scope": setup.compile_scope, "loss_upcast": setup.loss_upcast,
            "shard_embeddings": setup.shard_embeddings, "fsdp1_frozen_grads": setup.fsdp1_frozen_grads,
            "compile_loss": setup.compile_loss, "defer_grad_sync": setup.defer_grad_sync,
            "fp32_logits": setup.fp32_logits, "kbit_fp32_casts": setup.kbit_fp32_casts,
            "hf_llama_438": setup.hf_llama_438, "pp_keeps_logits": setup.pp_keeps_logits,
            "document_mask": setup.document_mask,
            "tp": setup.tp, "cp": setup.cp, "pp": setup.pp, "pp_schedule": setup.pp_schedule,
        },
        "estimator": estimator,
        "assumptions": list(est.assumptions) + why_notes(setup.task, setup.activation_checkpointing,
                                                          dict(est.breakdown)),
    }


def _what_would_fit(d: dict) -> str:
    """A pointer, not a search: GPUs that hold this peak, and the knob most likely to shrink it."""
    s = d["setup"]
    bigger = [g.slug for g in sorted(list_gpus(), key=lambda g: g.memory_bytes) if g.memory_bytes >= d["per_gpu_bytes"]]
    bits = [f"GPUs that hold {d['per_gpu_bytes'] / GIB:,.1f} GiB: {', '.join(bigger[:4])}" if bigger
            else "no GPU in the catalog holds it as set up"]
    if s["activation_checkpointing"] != "full":
        bits.append("--activation-checkpointing full recomputes activations instead of keeping them")
    plan = (f"gpuprov plan --model {shell_word(d['model']['name'])} --task {s['task']} --gpu {d['gpu']['slug']} "
            f"--gpus {s['gpus']}")
    bits.append(f"`{plan}` searches sharding, recompute and micro-batch on these GPUs")
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
    # the whole card, as plan's "of N GiB"; "usable" is plan's word for the card less its safety margin
    lines.append(f"{'GPU memory (whole card)':<28}{d['gpu_memory_bytes'] / GIB:>10.2f}")
    head = d["headroom_bytes"] / GIB
    verdict = "FITS" if d["fits"] else "DOES NOT FIT"
    lines.append(f"{verdict}: headroom {head:+.2f} GiB ({d['headroom_bytes'] / d['gpu_memory_bytes']:+.1%} of the GPU)")
    if not d["fits"]:
        lines.append(_what_would_fit(d))
    lines.append("")
    lines.append("assumes:")
    lines.extend(f"  - {a}" for a in d["assumptions"])
    return "\n".join(lines)


class _FrameworkChoice(click.Choice):
    """The preset names, read from the catalog only when click needs them (no YAML at import)."""

    def __init__(self) -> None:
        super().__init__((), case_sensitive=True)

    @property
    def choices(self):  # type: ignore[override]

        return names()

    @choices.setter
    def choices(self, value) -> None:
        pass



@click.command(name="estimate")
@click.option("--model", "model_name", default="7b", show_default=True,
              help="Preset (see `gpuprov models`), Hugging Face id (ORG/NAME: local cache, else the hub) "
                   "or config.json path.")
@click.option("--task", type=click.Choice(TASKS), default="full", show_default=True)
@click.option("--seq-len", type=int, default=4096, show_default=True, help="Tokens per sample.")
@setting_option("micro_batch", default=1, kind=int)  # range-checked with a one-line error
@click.option("--gpu", "gpu_slug", default="h100-80gb", show_default=True, help="GPU slug (see `gpuprov gpus`).")
@click.option("--gpus", type=int, default=8, show_default=True, help="Total GPUs.")
@click.option("--gpus-per-node", type=int, default=None, help="GPUs per node (default: min(8, --gpus)).")
@click.option("--sharding", type=click.Choice(SHARDINGS), default=None, help="Default: none on 1 GPU, else fsdp.")
@click.option("--shard-group", type=int, default=None, help="hsdp shard-group size (default: GPUs of one node).")
@setting_option("activation_checkpointing", help_tail="  [default: selective]")
@click.option("--precision", type=click.Choice(PRECISIONS), default=None, help="[default: bf16-mixed]")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default=None, help="[default: adamw]")
@click.option("--lora-rank", type=int, default=16, show_default=True)
@click.option("--lora-targets", default="all-linear", show_default=True,
              help="qv, attention, all-linear, or a comma list such as q_proj,v_proj.")
@click.option("--offload", type=click.Choice(OFFLOADS), default=None, help="[default: none]")
@setting_option("compile", "use_compile", help_tail=" (see --compile-scope).  [default: no-compile]")
@click.option("--chunked-cross-entropy/--no-chunked-cross-entropy", default=None, help="[default: no-chunked-cross-entropy]")
@setting_option("grad_accumulation", default=1, kind=int, help_tail="; > 1 keeps gradients through forward")
@click.option("--activation-offloading/--no-activation-offloading", default=None,
              help="Saved activations streamed to host memory.  [default: no-activation-offloading]")
@click.option("--optimizer-impl", type=click.Choice(OPTIMIZER_IMPLS), default=None,
              help="AdamW kernel: foreach adds one state-sized temporary at the step.  [default: fused]")
@click.option("--loss-impl", type=click.Choice(LOSS_IMPL_NAMES), default=None,
              help="Loss stack: hf (transformers >= 4.45, logits kept by the loop), hf-legacy (< 4.45, fp32 logits kept),"
                   " native (logits freed before backward, e.g. torchtitan/torchtune).  [default: hf]")
@click.option("--lora-dropout", type=float, default=None,
              help="LoRA dropout probability (> 0 keeps a dropped-out input copy + mask per adapted module).  [default: 0.0]")
@click.option("--qlora-base", type=click.Choice(("sharded", "replicated")), default=None,
              help="QLoRA NF4 base under FSDP: sharded (fsdp_qlora, accelerate with bnb_4bit_quant_storage) or "
                   "replicated on every GPU (gpuprov's trainer: FSDP2 cannot shard bitsandbytes weights).  [default: sharded]")
@click.option("--framework", default=None, type=_FrameworkChoice(),
              help="Size the stack this framework's code runs (catalog/data/frameworks.yaml; every setting cited). "
                   "Flags you give override it.")
@click.option("--fsdp-version", type=click.Choice(("1", "2")), default=None,
              help="1: FullyShardedDataParallel (flat parameters, accelerate's default); 2: fully_shard.  [default: 2]")
@click.option("--autocast-fp32-params/--no-autocast-fp32-params", default=None,
              help="bf16-mixed by torch.autocast over fp32 parameters with no FSDP MixedPrecision policy (Lightning "
                   "bf16-mixed): fp32 all-gathers, fp32 frozen base, fp32 residual/norms.  [default: no]")
@click.option("--compile-scope", type=click.Choice(COMPILE_SCOPES), default=None,
              help="With --compile: per decoder block (torchtitan, torchtune) or the whole model and its loss "
                   "(HF Trainer torch_compile).  [default: block]")
@click.option("--compile-loss/--no-compile-loss", default=None,
              help="With --compile --compile-scope block: the loss compiled apart (torchtune).  [default: no]")
@click.option("--loss-upcast/--no-loss-upcast", default=None,
              help="The loss casts the logits to fp32 before log-softmax.  [default: loss-upcast]")
@click.option("--shard-embeddings/--no-shard-embeddings", default=None,
              help="FSDP2: embeddings and output head are FSDP units of their own (torchtitan, torchtune).  [default: no]")
@click.option("--fsdp1-frozen-grads/--no-fsdp1-frozen-grads", default=None,
              help="FSDP1 LoRA with adapters inside the frozen base's flat parameter (use_orig_params=True, e.g. "
                   "Lightning's Block wrap): gradients cover the frozen base too.  [default: no]")
@click.option("--defer-grad-sync/--no-defer-grad-sync", default=None,
              help="Gradient accumulation without gradient sync (FSDP1 no_sync, FSDP2 set_requires_gradient_sync(False): "
                   "accelerate's accumulate(), Lightning): the full unsharded gradients stay between micro-batches.  [default: no]")
@click.option("--fp32-logits/--no-fp32-logits", default=None,
              help="The model returns fp32 logits (torchtune's unembed .float(); transformers < 4.45).  [default: no]")
@click.option("--kbit-fp32-casts/--no-kbit-fp32-casts", default=None,
              help="QLoRA prepared by peft's prepare_model_for_kbit_training: embeddings, norms and head cast to "
                   "fp32, so the residual stream and the 4-bit linears' outputs are fp32.  [default: no]")
@click.option("--hf-llama-438/--no-hf-llama-438", default=None,
              help="transformers 4.38's Llama code: a dense (batch, 1, max positions, max positions) causal mask "
                   "lives from the forward to the end of backward, and every layer keeps rotary cos/sin cache "
                   "buffers.  [default: no]")
@click.option("--float8/--no-float8", default=None,
              help="torchao float8 linears with FSDP2 float8 all-gather (full training): the blocks' linear "
                   "weights are gathered at 1 byte per parameter.  [default: no]")
@click.option("--float8-all-gather/--no-float8-all-gather", default=None,
              help="With --float8: FSDP2 gathers the linear weights in float8 (off: in bf16; torchtitan turns it "
                   "off without dp_shard ranks).  [default: yes]")
@click.option("--pp-keeps-logits/--no-pp-keeps-logits", default=None,
              help="With --pp: the last stage keeps every micro-batch's logits until the step ends and "
                   "concatenates them (torch pipelining's kept outputs; torchtitan of Dec 2024).  [default: no]")
@click.option("--document-mask/--no-document-mask", default=None,
              help="Per-document attention on packed samples (gpuprov's trainer with SDPA): a boolean batch x "
                   "seq/cp x seq mask per micro-batch, SDPA's additive copy of it in each layer, and under --cp "
                   "keys/values all-gathered instead of ring attention.  [default: no]")
@click.option("--tp", type=int, default=1, show_default=True,
              help="Tensor-parallel degree (+ sequence parallelism); at most the GPUs of one node.")
@click.option("--cp", type=int, default=1, show_default=True,
              help="Context-parallel degree (ring attention; with --document-mask keys and values all-gathered).")
@click.option("--pp", type=int, default=1, show_default=True,
              help="Pipeline-parallel degree; --grad-accumulation is the micro-batches per step.")
@click.option("--pp-schedule", type=click.Choice(PP_SCHEDULES), default="1F1B", show_default=True,
              help="torch.distributed.pipelining schedule with --pp (Interleaved1F1B: two stages per rank).")
@click.option("--suggest", is_flag=True, help="Also list the cheapest changes that make it fit (automatic when it does not).")
@click.option("--fail-if-not-fits", is_flag=True, help="Exit 3 when the estimate does not fit (for pipelines).")
@click.option("--precise", is_flag=True, help="Measure with PyTorch on fake tensors (needs the [precise] extra: torch, "
              "transformers, peft).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def estimate(model_name, task, seq_len, micro_batch, gpu_slug, gpus, gpus_per_node, sharding, shard_group,
             activation_checkpointing, precision, optimizer, lora_rank, lora_targets, offload, use_compile,
             chunked_cross_entropy, grad_accumulation, activation_offloading, optimizer_impl, loss_impl,
             lora_dropout, qlora_base, framework, fsdp_version, autocast_fp32_params, compile_scope, loss_upcast,
             shard_embeddings, fsdp1_frozen_grads, compile_loss, defer_grad_sync, fp32_logits, kbit_fp32_casts, float8,
             float8_all_gather, hf_llama_438, pp_keeps_logits, document_mask,
             tp, cp, pp, pp_schedule,
             suggest, fail_if_not_fits, precise, as_json) -> None:
    """Per-GPU peak memory of one training setup, term by term, and whether it fits.

    \b
    Examples:
      gpuprov estimate --model llama-3.1-8b --gpu h100-80gb --gpus 8
      gpuprov estimate --model 70b --task qlora --gpu rtx-4090-24gb --gpus 2
      gpuprov estimate --model meta-llama/Llama-3.1-8B --task lora --gpus 1 --json
      gpuprov estimate --model llama-3.1-8b --gpus 8 --seq-len 8192 --framework torchtitan
      gpuprov estimate --model 7b --task lora --gpus 1 --gpu rtx-4090-24gb --framework hf-trainer --suggest
      gpuprov estimate --model 70b --gpus 16 --framework litgpt --no-autocast-fp32-params --json
      gpuprov estimate --model 70b --gpus 64 --tp 8                    # TP 8 x FSDP 8
      gpuprov estimate --model 8b --gpus 8 --cp 4 --seq-len 131072     # context parallel 4
      gpuprov estimate --model 405b --gpus 512 --tp 8 --pp 8 --grad-accumulation 8 --pp-schedule Interleaved1F1B
    """
    arch = get_model(model_name)
    gpu = get_gpu(gpu_slug)
    params = _gpu_count_from_name(click.get_current_context(), gpu_slug)
    params["model_type"] = arch.model_type  # LoRA presets name the family's modules
    setup, explicit, shape, applied = setup_from_options(params)
    if precise and tp * cp * pp > 1:
        raise GpuprovError("--precise simulates FSDP on one rank; it does not model --tp/--cp/--pp yet (drop --precise)")
    analytic = estimate_memory(arch, setup, gpu.memory_bytes)
    est, kind = (run_precise(arch, setup, gpu.memory_bytes), "precise") if precise else (analytic, "analytic")
    d = result_dict(arch, gpu, setup, est, kind)
    d["defaults"] = _defaults_used(setup)
    if precise:
        d["analytic"] = {"per_gpu_bytes": analytic.per_gpu_bytes, "breakdown": dict(analytic.breakdown)}
    d["framework"] = framework_dict(framework, applied)
    fits = d["fits"]
    if suggest or not fits:
        base_cmd = command_words(model_name, gpu_slug, framework, shape, grad_accumulation, explicit)
        found = find(arch, gpu, setup, estimate_memory, gpu.memory_bytes,
                     rebuild=lambda flags: setup_from_options(params_with_flags(params, flags))[0])
        d["suggestions"] = [suggestion_dict(x, base_cmd) for x in found]
    click.echo(json.dumps(d, indent=2) if as_json else render_table(d) + render_stack(d))
    if fail_if_not_fits and not fits:
        raise SystemExit(3)


# option name -> the setup field it resolves to, where the two names differ
_OPTION_FIELD = {"use_compile": "compile", "grad_accumulation": "grad_accumulation_steps"}


def _defaults_used(setup) -> dict:
    """Every option the user did not give, with the value used (as resolved by the preset or derived)."""
    ctx = click.get_current_context()
    task, sharding = ctx.params.get("task"), setup.sharding
    unused = {"as_json", "precise", "suggest", "fail_if_not_fits"}
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
        field = _OPTION_FIELD.get(p.name, p.name)
        value = ctx.params.get(p.name) if p.name == "lora_targets" else getattr(setup, field, ctx.params.get(p.name))
        if p.name == "qlora_base":
            value = "replicated" if setup.qlora_base_replicated else "sharded"
        if value is not None:
            out[flag] = value
    return out


# ---------------------------------------------------------------------------- stack and suggestions


# stack field -> (flag, how a value renders: "choice" or "bool" as --x / --no-x)
STACK_FLAGS: dict[str, tuple[str, str]] = {
    "sharding": ("--sharding", "choice"), "activation_checkpointing": ("--activation-checkpointing", "choice"),
    "precision": ("--precision", "choice"), "optimizer": ("--optimizer", "choice"), "offload": ("--offload", "choice"),
    "compile": ("--compile", "bool"), "chunked_cross_entropy": ("--chunked-cross-entropy", "bool"),
    "activation_offloading": ("--activation-offloading", "bool"), "optimizer_impl": ("--optimizer-impl", "choice"),
    "loss_impl": ("--loss-impl", "choice"), "lora_dropout": ("--lora-dropout", "choice"),
    "qlora_base_replicated": ("--qlora-base", "qlora"), "fsdp_version": ("--fsdp-version", "choice"),
    "autocast_fp32_params": ("--autocast-fp32-params", "bool"), "compile_scope": ("--compile-scope", "choice"),
    "loss_upcast": ("--loss-upcast", "bool"), "shard_embeddings": ("--shard-embeddings", "bool"),
    "fsdp1_frozen_grads": ("--fsdp1-frozen-grads", "bool"), "compile_loss": ("--compile-loss", "bool"),
    "defer_grad_sync": ("--defer-grad-sync", "bool"), "fp32_logits": ("--fp32-logits", "bool"),
    "float8": ("--float8", "bool"), "float8_all_gather": ("--float8-all-gather", "bool"), "kbit_fp32_casts": ("--kbit-fp32-casts", "bool"),
    "hf_llama_438": ("--hf-llama-438", "bool"), "pp_keeps_logits": ("--pp-keeps-logits", "bool"),
    "document_mask": ("--document-mask", "bool"),
}


def flag_words(field: str, value) -> list[str]:
    flag, kind = STACK_FLAGS[field]
    if kind == "bool":
        return [flag if value else "--no-" + flag[2:]]
    if kind == "qlora":
        return [flag, "replicated" if value else "sharded"]
    return [flag, str(value)]


def framework_dict(framework, applied: dict) -> dict | None:
    if not framework:
        return None

    return {"name": framework, "title": title(framework),
            "set": {f: {"value": st.value, "flag": " ".join(flag_words(f, st.value)), "source": st.source}
                    for f, st in applied.items()}}


def command_words(model_name, gpu_slug, framework, shape: dict, grad_accumulation: int,
                  explicit: dict) -> list[tuple[str, str | None]]:
    """The user's run as (flag, value) pairs: shape, preset, and the stack flags they gave."""
    words: list[tuple[str, str | None]] = [
        ("--model", model_name), ("--gpu", str(gpu_slug).partition(":")[0]), ("--task", shape["task"]),
        ("--seq-len", str(shape["seq_len"])),
        ("--micro-batch", str(shape["micro_batch"])), ("--gpus", str(shape["gpus"]))]
    if shape["gpus_per_node"] is not None:
        words.append(("--gpus-per-node", str(shape["gpus_per_node"])))
    if shape["shard_group"] is not None:
        words.append(("--shard-group", str(shape["shard_group"])))
    for flag in ("tp", "cp", "pp"):
        if shape.get(flag, 1) > 1:
            words.append(("--" + flag, str(shape[flag])))
    if shape.get("pp", 1) > 1 and shape.get("pp_schedule", "1F1B") != "1F1B":
        words.append(("--pp-schedule", str(shape["pp_schedule"])))
    if shape["task"] != "full":
        words += [("--lora-rank", str(shape["lora_rank"])), ("--lora-targets", str(shape["lora_targets"]))]
    if grad_accumulation != 1:
        words.append(("--grad-accumulation", str(grad_accumulation)))
    if framework:
        words.append(("--framework", framework))
    for field, value in explicit.items():
        if value is not None:
            w = flag_words(field, value)
            words.append((w[0], w[1] if len(w) > 1 else None))
    return words


def _key(flag: str) -> str:
    return "--" + flag[5:] if flag.startswith("--no-") else flag


def with_flags(words: list[tuple[str, str | None]], flags: dict[str, str]) -> str:
    """The command with each changed flag's value replaced or the flag added (bool pairs: one of them)."""
    changed = {_key(f): (f, v or None) for f, v in flags.items()}
    kept = [(f, v) for f, v in words if _key(f) not in changed]
    out = ["gpuprov", "estimate"]
    for f, v in kept + list(changed.values()):
        out += [f] if v is None else [f, v]
    return shlex.join(out)


def params_with_flags(params: dict, flags: dict[str, str]) -> dict:
    """estimate's option values with a suggestion's flags (e.g. {"--task": "qlora"}) applied as typed."""
    ctx = click.get_current_context()
    by_flag = {opt: opt_param for opt_param in ctx.command.params for opt in opt_param.opts}
    out = dict(params)
    for flag, value in flags.items():
        param = by_flag[flag]
        out[param.name] = param.type_cast_value(ctx, value)
    return out


def suggestion_dict(x, base_cmd: list[tuple[str, str | None]]) -> dict:
    flags = flags_of(x.changes)
    return {
        "change": x.summary,
        "per_gpu_bytes": x.per_gpu_bytes,
        "gpu_seconds_per_token": x.gpu_seconds_per_token,
        "command": with_flags(base_cmd, flags),
        "notes": list(x.notes),
    }


def render_stack(d: dict) -> str:
    lines: list[str] = []
    fw = d.get("framework")
    if fw:
        lines += ["", f"framework {fw['name']}: {fw['title']}"]
        lines += [f"  sets {item['flag']:<34} ({item['source']})" for item in fw["set"].values()] or \
            ["  (every setting overridden by your flags)"]
    else:
        # The largest errors on measured runs come from a stack the estimate was not told.
        lines += ["", "no --framework: the stack flags not given are generic defaults (listed above); "
                  f"--framework {{{','.join(names())}}} sizes the stack that framework's code runs"]
    s = d["setup"]
    if s["task"] == "qlora":
        lines += ["", f"QLoRA base: NF4 {s['qlora_base']}" + (
            " on every GPU (gpuprov's trainer keeps the base out of FSDP2; `gpuprov plan` sizes it so)"
            if s["qlora_base"] == "replicated" else
            " by FSDP (fsdp_qlora / accelerate with bnb_4bit_quant_storage); gpuprov's trainer replicates it:"
            " --qlora-base replicated or --framework gpuprov")]
    if "suggestions" in d:
        if d["suggestions"]:
            lines += ["", "would fit with (cheapest first, by GPU-seconds per token from the planner's throughput model;"
                      " nodes joined by 400 Gb/s InfiniBand per GPU):"]
            for i, x in enumerate(d["suggestions"], 1):
                lines.append(f"  {i}. {x['change']}: {x['per_gpu_bytes'] / GIB:.2f} GiB per GPU, "
                             f"{x['gpu_seconds_per_token'] * 1e6:.1f} GPU-us/token")
                lines += [f"     {n}" for n in x["notes"]]
                lines.append(f"     {x['command']}")
        else:
            lines += ["", "no single change or pair of changes makes it fit; try a larger GPU (`gpuprov gpus`)"]
    return "\n".join(lines)
