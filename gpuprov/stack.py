"""The training software stack: one choice, read by the memory estimate and by launch/train.yaml.

`choose_stack` decides it from the spec (task, precision) and the model type, with framework
facts from catalog/data/trainer.yaml; `setup_fields` is what the estimator is told about it
(gpuprov/sizing/setup.py builds every setup from it; tests hold the plan's memory figure,
train.yaml and that setup to one another).
"""

from __future__ import annotations

from typing import Any

from gpuprov.catalog import load_data
from gpuprov.errors import GpuprovError
from gpuprov.plan import Stack

# plan precision: (FSDP2 param_dtype, reduce_dtype, dtype of the sharded master weights + optimizer)
PRECISIONS = {
    "bf16-mixed": ("bfloat16", "float32", "float32"),
    "bf16": ("bfloat16", "bfloat16", "bfloat16"),
    "fp32": ("float32", "float32", "float32"),
}


def _facts() -> dict:
    return load_data("trainer.yaml")


def compile_refusal(task: str) -> str | None:
    """Why the trainer cannot torch.compile this task (catalog/data/trainer.yaml compile); None if it can."""
    c = _facts()["compile"]
    if task in c["tasks"]:
        return None
    return (f"compile: the trainer compiles {' and '.join(c['tasks'])} training only; {task}'s 4-bit base "
            "matmuls are custom autograd functions torch.compile cannot trace: use --no-compile")


def attention_kernel(attention: str, cp: int = 1) -> str:
    """What computes the attention core on the bundle's packed data (catalog/data/trainer.yaml attention_kernels)."""
    kernels = _facts()["attention_kernels"]
    if cp > 1:  # every model's attention is the trainer's cp_attention: masked SDPA on the gathered window
        return kernels["sdpa"] + "; " + kernels["cp_documents"]
    return kernels[attention]


def attention_notes(plan: Any) -> list[str]:
    """Said when the trainer's attention kernel is not the one the step-time model's measured runs used
    (the Stack records which it is: stack.attention_kernel)."""
    stack, c, tp = plan.stack, plan.cluster, plan.throughput
    if stack is None or (stack.attention == "flash_attention_2" and c.cp == 1):
        return []
    share = tp.attention_flops_per_token / tp.flops_per_token if tp.flops_per_token else 0.0
    kernels = _facts()["attention_kernels"]
    ran = f"Attention: the trainer runs {stack.attention_kernel or attention_kernel(stack.attention, c.cp)} on the packed samples"
    cp = f"; {kernels['cp_timed']}" if c.cp > 1 else ""
    if document_mask(stack, c.cp):
        return [f"{ran}: the step time counts every score tile it computes (attention is {share:.0%} of the model "
                f"FLOPs at {c.seq_len:,} tokens; the kernel computes up to twice that) at {kernels['timed_rate']}{cp}, so "
                f"attention may take longer than planned (its memory is sized as the trainer runs it)"]
    return [f"{ran}; the step time is modelled on runs with {kernels['timed_as']}, so attention ({share:.0%} of the "
            f"model FLOPs at {c.seq_len:,} tokens) may take longer than planned (its memory is sized as the trainer runs it)"]


def choose_stack(task: str, precision: str, model_type: str, tp: int = 1, float8: bool = False,
                 compile: bool | None = None, cp: int = 1) -> Stack:
    """The stack for this task, precision and model type; `tp` the chosen layout's tensor-parallel
    degree (the loss is chunked only without TP); `float8` as the planner decided it for the GPU;
    `compile` as the user fixed it (None: per task, catalog/data/trainer.yaml compile); `cp` its
    context-parallel degree (the attention kernel it runs)."""
    if precision not in PRECISIONS:
        raise GpuprovError(f"the trainer has no setting for precision {precision!r}")
    facts = _facts()
    param, reduce, master = PRECISIONS[precision]
    attention = facts["attention"]["by_model_type"].get(model_type, facts["attention"]["default"])
    return Stack(
        param_dtype=param, reduce_dtype=reduce, master_dtype=master,
        # the estimate sizes a LoRA base in bf16 (never fp32: it has no optimizer to feed)
        frozen_dtype={"full": None, "lora": "bfloat16", "qlora": "nf4"}[task],
        qlora_base_replicated=task == "qlora",
        attention=attention,
        attention_kernel=attention_kernel(attention, cp),
        loss_impl="native",  # train.py deletes the logits before backward
        chunked_cross_entropy=bool(facts["loss"]["chunked_cross_entropy"]) and tp == 1,
        compile=task in facts["compile"]["tasks"] if compile is None else bool(compile),
        float8=float8,
        tf32=param == "float32",  # fp32 compute: the plan times it on TF32 tensor cores
        optimizer_impl="fused",
        lora_dropout=0.0,
        activation_offloading=False,
        async_checkpoint=True,
        min_torch=str(facts["torch"]["min_version"]),
        source="; ".join(facts[k]["source"] for k in ("torch", "attention", "attention_kernels", "compile", "loss")),
    )


# What train.py always does, in the estimator's words (catalog/data/frameworks.yaml `gpuprov` cites
# each; tests hold that preset, this function and train.py to one another): FSDP2 with a
# MixedPrecisionPolicy (no autocast over fp32 parameters), embeddings and norm+head as FSDP units
# of their own, compile per block, the loss upcast to fp32.
TRAINER_CONSTANTS = dict(fsdp_version=2, autocast_fp32_params=False, shard_embeddings=True,
                         compile_scope="block", loss_upcast=True)


def document_mask(stack: Any, cp: int = 1) -> bool:
    """The trainer hands its attention a dense per-document mask (setup_fields says when): SDPA on packed data,
    and under CP every model (cp_gathers)."""
    return stack.attention == "sdpa" or (cp > 1 and cp_gathers(stack))


def cp_gathers(stack: Any) -> bool:
    """Under CP the bundle's trainer attends per document: it switches every model's attention to cp_attention
    (templates/launch/parallel.py parallelize), which all-gathers keys and values over the CP group and runs
    masked SDPA on the whole window, not ring attention, whenever the batch carries document ids (step_context),
    as every bundle's data does (setup_fields). Any plan with a Stack runs gpuprov's trainer."""
    return stack is not None


def setup_fields(stack: Stack, tp: int = 1, cp: int = 1) -> dict[str, Any]:
    """The estimator's (TrainSetup) view of the stack, for a layout of tensor-parallel degree `tp`:
    train.py chunks the loss only without TP (with it, loss_parallel runs on vocab-sharded logits).

    Document masks: the bundle trains on what its prepare_data.py wrote, which records every sample's start
    (`<shard>.starts`), and data.document_attention is on by default (templates/launch/train_config.py), so the
    trainer builds a per-document mask for SDPA (train_attention.py model_inputs); flash_attention_2 gets
    restarting positions and no mask, except under CP, where every model gets the mask (cp_gathers). A run on data
    without recorded starts builds none: the plan sizes the default, which is the larger."""
    return dict(compile=stack.compile, document_mask=document_mask(stack, cp),
                chunked_cross_entropy=stack.chunked_cross_entropy and tp == 1,
                loss_impl=stack.loss_impl, optimizer_impl=stack.optimizer_impl,
                qlora_base_replicated=stack.qlora_base_replicated, lora_dropout=stack.lora_dropout,
                activation_offloading=stack.activation_offloading, float8=stack.float8, **TRAINER_CONSTANTS)
