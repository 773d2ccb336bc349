"""One path to the estimator's TrainSetup, from a Plan, from a planner candidate or from flags.

`make_setup` is the one constructor: the planner calls it for every candidate, `setup_from_plan`
rebuilds the chosen one from plan.json (validate, gitops, tests), and `build_setup` /
`setup_from_options` turn `gpuprov estimate`'s flags into the same object. The gpuprov trainer's
stack comes from the Plan's Stack (gpuprov/stack.py); another framework's from its preset
(catalog/data/frameworks.yaml). A setup built twice from the same facts is the same setup, so
`validate` reports exactly the figure the plan was sized with.
"""

from __future__ import annotations

from dataclasses import fields as dataclass_fields
from typing import Any

from gpuprov.catalog.models import model_from_config
from gpuprov.errors import GpuprovError
from gpuprov.sizing.arch import ModelArch, resolve_lora_targets
from gpuprov.sizing.frameworks import STACK_FIELDS, preset_stack, resolve
from gpuprov.sizing.types import LORA_TARGET_PRESETS, TrainSetup
from gpuprov.stack import choose_stack, setup_fields


def make_setup(*, grad_accum: int, framework: str | None = "gpuprov", stack: Any = None, **fields: Any) -> TrainSetup:
    """The estimator's setup for one configuration, as the named framework's code runs it.

    `grad_accum` (global batch / (micro-batch x seq-len x data-parallel ranks)) decides whether
    gradients stay alive through the next forward. QLoRA: the trainer leaves the NF4 base out of
    FSDP2 (it cannot shard bitsandbytes weights), so every GPU holds all of it. `stack` (the
    Plan's Stack) carries the rest of what the trainer runs: loss, compile, optimizer step.
    `framework=None`: `fields` already hold every stack field (estimate's resolved flags).
    """
    extra: dict[str, Any] = {}
    if framework == "gpuprov":  # the bundle's own trainer: the Plan's Stack says what it runs
        if stack is None:  # the stack any model of this task and precision gets (attention aside)
            stack = choose_stack(fields.get("task", "full"), fields.get("precision", "bf16-mixed"), "")
        extra = setup_fields(stack, tp=int(fields.get("tp", 1)), cp=int(fields.get("cp", 1)))
    elif framework is not None:  # another framework's stack (catalog/data/frameworks.yaml); the candidate's own fields win
        preset = preset_stack(framework, fields.get("task", "full"), fields.get("sharding", "fsdp"),
                              int(fields.get("tp", 1)))
        extra = {k: v for k, v in preset.items() if k not in fields}
    return TrainSetup(**fields, **extra, grad_accumulation_steps=max(1, int(grad_accum)))


def setup_from_plan(plan: Any) -> TrainSetup:
    """The TrainSetup the planner sized the chosen configuration with, from the Plan alone."""
    c, t = plan.cluster, plan.training
    if plan.stack is None:
        raise GpuprovError("this plan records no training stack: run `gpuprov plan` again")
    return make_setup(
        task=plan.task, seq_len=c.seq_len, micro_batch=c.micro_batch, gpus=c.total_gpus,
        gpus_per_node=c.gpus_per_node, sharding=c.sharding,
        shard_group=c.replica_gpus if c.sharding == "hsdp" else None,  # the estimator's group spans the stages
        activation_checkpointing=c.activation_checkpointing, precision=c.precision, optimizer=c.optimizer,
        offload=c.offload, lora_rank=t.lora_rank or 16,
        lora_targets=tuple(t.lora_targets) if plan.task != "full" else LORA_TARGET_PRESETS["all-linear"],
        tp=c.tp, cp=c.cp, pp=c.pp, pp_schedule=c.pp_schedule, grad_accum=c.grad_accum,
        framework=plan.spec.framework, stack=plan.stack)


def arch_from_plan(plan: Any) -> ModelArch:
    """The architecture from the config.json the plan carries (presets and paths alike; no file or
    network needed, so a bundle checks the same on any machine)."""
    m = plan.model
    return model_from_config(dict(m.hf_config), name=m.name, display_name=m.display_name, source=m.source)


# ------------------------------------------------------------------------------ from flags
def stack_defaults() -> dict[str, object]:
    """Each stack field when neither a flag nor a --framework preset sets it: TrainSetup's default, except
    the sharding, whose default depends on the GPU count (none on one GPU, else fsdp)."""
    out: dict[str, object] = {f.name: f.default for f in dataclass_fields(TrainSetup) if f.name in STACK_FIELDS}
    out["sharding"] = None
    return out


def default_sharding(gpus: int, model_parallel: int = 1) -> str:
    # TP/CP/PP run under FSDP2 even on one data-parallel rank (torchtitan's mesh)
    return "none" if gpus == 1 and model_parallel == 1 else "fsdp"


def resolve_stack(framework: str | None, explicit: dict, *, task: str, gpus: int, model_parallel: int = 1,
                  tp: int = 1) -> tuple[dict, dict]:
    """Stack fields from explicit flags > the --framework preset > stack_defaults(); and what the preset set."""
    def shape_of(values: dict) -> dict:
        return {"task": task, "sharding": values.get("sharding") or default_sharding(gpus, model_parallel),
                "tensor_parallel": tp > 1}

    values, applied = resolve(framework, explicit, stack_defaults(), shape_of)
    if values["sharding"] is None:
        values["sharding"] = default_sharding(gpus, model_parallel)
    return values, applied


def _check_shape(seq_len: int, micro_batch: int, gpus: int, gpus_per_node: int | None, lora_rank: int,
                 grad_accumulation: int, tp: int, cp: int, pp: int) -> int:
    """The shape flags' one-line errors; the GPUs per node (default min(8, gpus))."""
    for flag, value in (("--seq-len", seq_len), ("--micro-batch", micro_batch), ("--gpus", gpus),
                        ("--lora-rank", lora_rank), ("--grad-accumulation", grad_accumulation),
                        ("--tp", tp), ("--cp", cp), ("--pp", pp)):
        if value <= 0:
            raise GpuprovError(f"{flag} must be a positive integer, got {value}")
    if gpus_per_node is None:
        return min(8, gpus)
    if gpus_per_node <= 0:
        raise GpuprovError(f"--gpus-per-node must be a positive integer, got {gpus_per_node}")
    if gpus % gpus_per_node:
        raise GpuprovError(f"--gpus {gpus} is not a whole number of nodes of --gpus-per-node {gpus_per_node}")
    return gpus_per_node


def build_setup(
    *, task: str, seq_len: int, micro_batch: int, gpus: int, gpus_per_node: int | None, shard_group: int | None,
    lora_rank: int, lora_targets: Any, grad_accumulation: int = 1, stack: dict | None = None,
    tp: int = 1, cp: int = 1, pp: int = 1, pp_schedule: str = "1F1B", model_type: str | None = None,
) -> TrainSetup:
    """The setup `gpuprov estimate` sizes: its shape flags and a resolved stack (resolve_stack); LoRA
    presets as `model_type`'s module names."""
    gpus_per_node = _check_shape(seq_len, micro_batch, gpus, gpus_per_node, lora_rank, grad_accumulation, tp, cp, pp)
    values = dict(stack_defaults(), **(stack or {}))
    if values["sharding"] is None:
        values["sharding"] = default_sharding(gpus, tp * cp * pp)
    if shard_group is not None and values["sharding"] != "hsdp":
        raise GpuprovError("--shard-group applies to --sharding hsdp only")
    if not 0.0 <= float(values["lora_dropout"]) < 1.0:  # type: ignore[arg-type]
        raise GpuprovError(f"--lora-dropout must be in [0, 1), got {values['lora_dropout']}")
    return make_setup(
        task=task, seq_len=seq_len, micro_batch=micro_batch, gpus=gpus, gpus_per_node=gpus_per_node,
        shard_group=shard_group, lora_rank=lora_rank, lora_targets=resolve_lora_targets(lora_targets, model_type),
        tp=tp, cp=cp, pp=pp, pp_schedule=pp_schedule, grad_accum=grad_accumulation, framework=None, **values)


# stack flags whose option name is the TrainSetup field (compile, qlora_base and fsdp_version convert)
EXPLICIT_STACK = ("sharding", "activation_checkpointing", "precision", "optimizer", "offload", "chunked_cross_entropy",
                  "activation_offloading", "optimizer_impl", "loss_impl", "lora_dropout", "autocast_fp32_params",
                  "compile_scope", "loss_upcast", "shard_embeddings", "fsdp1_frozen_grads", "compile_loss",
                  "defer_grad_sync", "fp32_logits", "float8", "kbit_fp32_casts",
                  "float8_all_gather", "hf_llama_438", "pp_keeps_logits", "document_mask")
SHAPE_OPTIONS = ("task", "seq_len", "micro_batch", "gpus", "gpus_per_node", "shard_group",
                 "lora_rank", "lora_targets", "tp", "cp", "pp", "pp_schedule")


def setup_from_options(p: dict) -> tuple[TrainSetup, dict, dict, dict]:
    """(setup, explicit stack flags, shape, what the preset set) from estimate's option values: one path
    for the run itself and for each suggested command, so a suggestion sizes what its command sizes
    (a preset's `when:` rules follow a changed --task or --sharding)."""
    qlora_base, fsdp_version = p["qlora_base"], p["fsdp_version"]
    explicit = {name: p[name] for name in EXPLICIT_STACK}
    explicit.update(compile=p["use_compile"],
                    qlora_base_replicated=None if qlora_base is None else qlora_base == "replicated",
                    fsdp_version=None if fsdp_version is None else int(fsdp_version))
    stack, applied = resolve_stack(p["framework"], explicit, task=p["task"], gpus=p["gpus"],
                                   model_parallel=p["tp"] * p["cp"] * p["pp"], tp=p["tp"])
    shape = {k: p[k] for k in SHAPE_OPTIONS}
    setup = build_setup(**shape, grad_accumulation=p["grad_accumulation"], stack=stack, model_type=p.get("model_type"))
    return setup, explicit, shape, applied
