"""Data contracts of the sizing engine, shared by the estimator, the planner and precise mode.

Pure data: no I/O. Bytes are integers. The estimator (`gpuprov.sizing.memory.estimate_memory`)
maps (ModelArch, TrainSetup, GPU memory) to a MemoryEstimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Task = Literal["full", "lora", "qlora"]
Sharding = Literal["none", "ddp", "zero1", "zero2", "fsdp", "hsdp"]
ActivationCheckpointing = Literal["none", "selective", "full"]
Precision = Literal["bf16-mixed", "bf16", "fp32"]
Optimizer = Literal["adamw", "adamw-8bit"]
Offload = Literal["none", "optimizer", "full"]

TASKS: tuple[str, ...] = ("full", "lora", "qlora")
SHARDINGS: tuple[str, ...] = ("none", "ddp", "zero1", "zero2", "fsdp", "hsdp")
AC_MODES: tuple[str, ...] = ("none", "selective", "full")
PRECISIONS: tuple[str, ...] = ("bf16-mixed", "bf16", "fp32")
OPTIMIZERS: tuple[str, ...] = ("adamw", "adamw-8bit")
OFFLOADS: tuple[str, ...] = ("none", "optimizer", "full")
LORA_TARGET_PRESETS: dict[str, tuple[str, ...]] = {
    "qv": ("q_proj", "v_proj"),
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "all-linear": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}


@dataclass(frozen=True)
class TrainSetup:
    """One training configuration on one cluster shape: everything memory depends on."""

    task: Task = "full"
    seq_len: int = 4096
    micro_batch: int = 1
    gpus: int = 1
    gpus_per_node: int = 8
    sharding: Sharding = "fsdp"
    shard_group: int | None = None  # hsdp shard-group size; None = gpus of one node
    activation_checkpointing: ActivationCheckpointing = "selective"
    precision: Precision = "bf16-mixed"
    optimizer: Optimizer = "adamw"
    offload: Offload = "none"
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = LORA_TARGET_PRESETS["all-linear"]
    compile: bool = False
    chunked_cross_entropy: bool = False
    # Model-parallel degrees (torchtitan layout): tensor (+ sequence) parallel, context parallel
    # (ring attention), pipeline stages; FSDP/HSDP/DDP spans what is left (gpus / (tp*cp*pp)).
    tp: int = 1
    cp: int = 1
    pp: int = 1


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak memory on the busiest GPU, term by term (bytes)."""

    per_gpu_bytes: int
    breakdown: dict[str, int]  # term name -> bytes; sums to per_gpu_bytes
    model_states_bytes: int  # weights + grads + optimizer (+ master) over ALL GPUs
    trainable_params: int
    assumptions: tuple[str, ...] = field(default_factory=tuple)
