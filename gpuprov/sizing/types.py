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
CompileScope = Literal["block", "model"]
LossImpl = Literal["hf", "hf-legacy", "native"]
OptimizerImpl = Literal["fused", "foreach"]
# torch.distributed.pipelining schedules the trainer runs and the estimator walks (sizing/pipeline.py)
PpSchedule = Literal["1F1B", "Interleaved1F1B"]

TASKS: tuple[str, ...] = ("full", "lora", "qlora")
SHARDINGS: tuple[str, ...] = ("none", "ddp", "zero1", "zero2", "fsdp", "hsdp")
AC_MODES: tuple[str, ...] = ("none", "selective", "full")
PRECISIONS: tuple[str, ...] = ("bf16-mixed", "bf16", "fp32")
OPTIMIZERS: tuple[str, ...] = ("adamw", "adamw-8bit")
OFFLOADS: tuple[str, ...] = ("none", "optimizer", "full")
COMPILE_SCOPES: tuple[str, ...] = ("block", "model")
LOSS_IMPL_NAMES: tuple[str, ...] = ("hf", "hf-legacy", "native")
OPTIMIZER_IMPLS: tuple[str, ...] = ("fused", "foreach")
FSDP_VERSIONS: tuple[int, ...] = (1, 2)
PP_SCHEDULES: tuple[str, ...] = ("1F1B", "Interleaved1F1B")
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
    # -- the software stack (what a framework preset sets; see catalog/data/frameworks.yaml) --
    activation_offloading: bool = False  # saved activations streamed to host memory (torchtune)
    grad_accumulation_steps: int = 1  # >1 keeps gradients alive through every forward
    optimizer_impl: OptimizerImpl = "fused"  # fused (no step temporaries) or foreach (PyTorch's default)
    qlora_base_replicated: bool = False  # NF4 base kept whole on every GPU (left out of FSDP)
    loss_impl: LossImpl = "hf"  # how long the logits live (gpuprov.sizing.memory.LOSS_IMPLS)
    lora_dropout: float = 0.0  # PEFT/torchtune LoRA dropout (> 0 saves a dropped-out input + mask)
    fsdp_version: int = 2  # 1: FullyShardedDataParallel (flat parameters); 2: fully_shard (per-parameter DTensor)
    # bf16-mixed by torch.autocast over fp32 parameters, with no FSDP mixed-precision policy: FSDP gathers
    # fp32, the frozen base stays fp32, the residual stream, norms and embeddings run in fp32.
    autocast_fp32_params: bool = False
    # QLoRA prepared by peft's prepare_model_for_kbit_training: every parameter that is not 4-bit (embeddings,
    # norms, output head) is cast to fp32, so the residual stream runs fp32 and bitsandbytes' Linear4bit
    # hands its outputs back in that dtype
    kbit_fp32_casts: bool = False
    compile_scope: CompileScope = "block"  # with compile: per decoder block, or the whole model (+ its loss)
    loss_upcast: bool = True  # the loss casts the logits to fp32 before log-softmax
    fp32_logits: bool = False  # the model returns fp32 logits (torchtune unembed `.float()`)
    compile_loss: bool = False  # with per-block compile: the loss compiled apart (torchtune compile_loss)
    shard_embeddings: bool = False  # FSDP2: embeddings and output head are FSDP units of their own
    # FSDP1 with LoRA adapters inside the frozen base's flat parameter (use_orig_params=True, one unit per
    # block): the flat parameter requires grad, so its gradient covers the frozen base as well
    fsdp1_frozen_grads: bool = False
    # gradient accumulation without reduce-scatter between micro-batches (FSDP1 no_sync(), FSDP2
    # set_requires_gradient_sync(False): accelerate accumulate(), Lightning no_backward_sync): FSDP keeps the
    # full unsharded gradients until the synchronising micro-batch
    defer_grad_sync: bool = False
    # Model-parallel degrees (torchtitan layout): tensor (+ sequence) parallel, context parallel
    # (ring attention), pipeline stages; FSDP/HSDP/DDP spans what is left (gpus / (tp*cp*pp)).
    tp: int = 1
    cp: int = 1
    pp: int = 1
    # torch.distributed.pipelining schedule with PP (gpuprov.sizing.pipeline.SCHEDULES); the micro-batches of a
    # step are grad_accumulation_steps (torchtitan's default: the PP degree)
    pp_schedule: str = "1F1B"
    # torchao float8 linears with FSDP2 float8 all-gather: the decoder blocks' linear weights are gathered
    # (and held unsharded) at 1 byte per parameter
    float8: bool = False
    # with float8: FSDP2 gathers the linears' weights in float8 (torchao enable_fsdp_float8_all_gather). torchtitan
    # turns it on only where its config asks and FSDP has dp_shard ranks (torchtitan@9dec370 torchtitan/float8.py:
    # `parallel_dims.dp_shard_enabled and float8_config.enable_fsdp_float8_all_gather`); off, the gathered weights
    # are in the compute dtype
    float8_all_gather: bool = True
    # transformers 4.38's Llama modelling code: a dense (batch, 1, max_positions, max_positions) additive causal
    # mask in the compute dtype every forward, handed to every decoder block (4.39 went back to SDPA's
    # is_causal), and per-attention-layer rotary cos/sin cache buffers (gpuprov.sizing.activations
    # dense_causal_mask_bytes, hf_buffer_bytes)
    hf_llama_438: bool = False
    # with PP: the last stage keeps every micro-batch's logits until the step ends and concatenates them as the
    # step returns (torch.distributed.pipelining output_chunks + _merge_outputs, as torchtitan@9dec370 ran it:
    # pp_schedule.step without return_outputs). Off: its forward ends in the loss (gpuprov
    # templates/launch/train_pipeline.py stage_forward) or the schedule is told not to keep outputs
    # (torchtitan@b5bcd76 trainer.py: return_outputs=False)
    pp_keeps_logits: bool = False
    # per-document attention on packed samples (gpuprov templates/launch/train_attention.py): the model gets one
    # boolean [b, 1, q, s] mask per micro-batch (q = s / cp), which SDPA turns into an additive bias of the compute
    # dtype in every layer (gpuprov.sizing.activations.document_masks); under CP the keys and values are
    # all-gathered over the CP group instead of ring attention (gpuprov.sizing.parallel.cp_kv_gather)
    document_mask: bool = False


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak memory on the busiest GPU, term by term (bytes)."""

    per_gpu_bytes: int
    breakdown: dict[str, int]  # term name -> bytes; sums to per_gpu_bytes
    model_states_bytes: int  # weights + grads + optimizer (+ master) over ALL GPUs
    trainable_params: int
    assumptions: tuple[str, ...] = field(default_factory=tuple)
