"""Model states on one GPU: parameters, gradients, optimizer states and what FSDP gathers.

Part of the analytic estimate (gpuprov.sizing.memory): FSDP2 bf16-mixed keeps fp32 sharded params,
grads and two fp32 AdamW states; DeepSpeed ZeRO bf16 keeps bf16 params/grads beside fp32 master and
states; LoRA/QLoRA freeze the base (bf16, or NF4 decoder linears for QLoRA). Constants live in
catalog/data/memory_constants.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuprov.catalog import load_data
from gpuprov.sizing.arch import ModelArch, resolve_lora_targets
from gpuprov.sizing.types import TrainSetup


def constants() -> dict:
    return load_data("memory_constants.yaml")


# ---------------------------------------------------------------------------- the stack's switches


def loss_compiled(s: TrainSetup) -> bool:
    """The loss itself compiled: with the whole model, or apart (torchtune compile_loss). Per-block
    compile alone (torchtitan, gpuprov's trainer) leaves the loss eager."""
    return s.compile and (s.compile_scope == "model" or s.compile_loss)


def autocast_fp32(s: TrainSetup) -> bool:
    """bf16 compute by torch.autocast over fp32 parameters: always so for bf16-mixed full training
    without sharding (DDP / one GPU); under FSDP/ZeRO or for LoRA only where the stack says so."""
    return s.precision == "bf16-mixed" and bool(s.autocast_fp32_params)


def kbit_fp32(s: TrainSetup) -> bool:
    """QLoRA after peft's prepare_model_for_kbit_training (peft 0.13.2 peft/utils/other.py: "cast all non
    INT8 parameters to fp32", `param.data = param.data.to(torch.float32)` for every fp16/bf16 parameter that
    is not a Params4bit)."""
    return s.task == "qlora" and bool(getattr(s, "kbit_fp32_casts", False))


def float8_gather(s: TrainSetup) -> bool:
    """torchao float8 with FSDP2 float8 all-gather (full training: the float8 linears are trainable)."""
    return (bool(s.float8) and bool(getattr(s, "float8_all_gather", True)) and s.task == "full"
            and s.sharding in ("fsdp", "hsdp") and s.fsdp_version == 2)


def unsharded_accumulation(s: TrainSetup) -> bool:
    return bool(s.defer_grad_sync) and s.grad_accumulation_steps > 1 and s.sharding in ("fsdp", "hsdp")


def frozen_flat_grads(s: TrainSetup) -> bool:
    return bool(s.fsdp1_frozen_grads) and s.fsdp_version == 1 and s.task == "lora" and s.sharding in ("fsdp", "hsdp")


def pipeline_keeps_stage(s: TrainSetup) -> bool:
    """FSDP under pipeline parallelism keeps each stage's blocks and gradients unsharded through the step.

    torchtitan shards every block with reshard_after_forward=False when PP is on
    (pytorch/torchtitan@9dec370ad26b5f8e9a7333a0e36165018262644b torchtitan/parallelisms/parallelize_llama.py
    apply_fsdp, `if pp_enabled: reshard_after_forward = False`), and the pipelining stage turns resharding
    after backward and gradient sync off for every micro-batch's backward, resharding and reducing only
    after the last (pytorch/pytorch@88fa1e7170b48d369c6b00d545a89e97fb9e2e43
    torch/distributed/pipelining/stage.py backward_maybe_with_nosync: set_reshard_after_backward(False),
    set_requires_gradient_sync(False)); FSDP2 then accumulates the unsharded gradients in the reduce dtype
    (FSDPParam.unsharded_accumulated_grad)."""
    return (getattr(s, "pp", 1) or 1) > 1 and s.sharding in ("fsdp", "hsdp")


def compute_bytes(s: TrainSetup) -> int:
    """Bytes per element of what FSDP gathers and the frozen base is loaded in (fp32 under autocast, and
    the non-4-bit parameters of a QLoRA model peft prepared)."""
    return 4 if (s.precision == "fp32" or autocast_fp32(s) or kbit_fp32(s)) else 2


# ---------------------------------------------------------------------------- per-parameter sizes


def nf4_bytes_per_param() -> float:
    nf4 = constants()["nf4"]
    absmax = nf4["double_quant_absmax_bytes"] / nf4["blocksize"]
    scales = nf4["double_quant_scale_bytes"] / (nf4["blocksize"] * nf4["double_quant_blocksize"])
    return nf4["weight_bits"] / 8 + absmax + scales


def optimizer_bytes_per_param(optimizer: str, state_elem_bytes: int) -> float:
    if optimizer == "adamw-8bit":
        q = constants()["adamw_8bit"]
        return 2 * (q["state_bytes"] + q["absmax_bytes"] / q["blocksize"])
    return 2 * state_elem_bytes  # AdamW exp_avg + exp_avg_sq, in the parameter's dtype


@dataclass(frozen=True)
class Weights:
    """Per-GPU model-state bytes and the shapes FSDP gathers."""

    params: int
    grads: int
    optimizer: int
    master: int
    layer_compute_bytes: int  # one decoder block as used in compute (bf16 / NF4 / fp32)
    layer_trainable: int  # trainable params in one block
    root_compute_bytes: int  # embeddings + head (+ final norm) as used in compute
    head_params: int  # output projection (or the tied embedding) parameters
    trainable: int
    quant_state: int = 0  # QLoRA absmax/scales: not a parameter, so neither sharded nor offloaded


@dataclass(frozen=True)
class _Shards:
    """Ways the parameters, gradients and optimizer states are split on one GPU."""

    param: int
    grad: int
    opt: int


def _shards(s: TrainSetup, shard: int) -> _Shards:
    fsdp = s.sharding in ("fsdp", "hsdp")
    zero = s.sharding in ("zero1", "zero2")
    grad = shard if (fsdp or s.sharding == "zero2") else 1
    if fsdp and (unsharded_accumulation(s) or pipeline_keeps_stage(s)):
        # FSDP1 no_sync() accumulates "the full model gradients (instead of gradient shards)"; FSDP2 without
        # gradient sync keeps FSDPParam.unsharded_accumulated_grad in the reduce dtype
        grad = 1
    return _Shards(param=shard if fsdp else 1, grad=grad, opt=shard if (fsdp or zero) else 1)


def _root_params(arch: ModelArch, s: TrainSetup) -> int:
    root = arch.params - arch.blocks_params()
    if s.shard_embeddings and arch.lm_head_params:
        # embeddings are their own FSDP unit, resharded after forward: only the head (+ final norm) is
        # gathered at the start of backward (torchtitan fsdp.py, torchtune custom_sharded_layers)
        root -= arch.embedding_params
    return root


def _full_states(arch: ModelArch, s: TrainSetup, d: _Shards) -> Weights:
    P, layer_params = arch.params, arch.layer_params()
    act = compute_bytes(s)
    if s.precision == "bf16-mixed" and s.sharding in ("zero1", "zero2"):
        # DeepSpeed bf16: bf16 params/grads, fp32 master and fp32 gradient partitions.
        params = 2 * P
        grads = 2 * P // d.grad + 4 * P // d.opt
        master = 4 * P // d.opt
        opt = optimizer_bytes_per_param(s.optimizer, 4) * P / d.opt
    else:
        elem = 2 if s.precision == "bf16" else 4  # bf16-mixed keeps fp32 params (FSDP2 / AMP)
        params = elem * P // d.param
        grads = elem * P // d.grad
        master = 0
        opt = optimizer_bytes_per_param(s.optimizer, elem) * P / d.opt
    layer_compute = act * layer_params
    if float8_gather(s):
        # the linears' weights are cast to float8 before the all-gather and held so (torchao
        # WeightWithDynamicFloat8CastTensor); norms stay in the compute dtype, the root is not float8
        linear = arch.layer_linear_params()
        layer_compute = constants()["float8"]["gather_bytes"] * linear + act * (layer_params - linear)
    return Weights(
        params=int(params), grads=int(grads), optimizer=int(opt), master=int(master),
        layer_compute_bytes=int(layer_compute), layer_trainable=int(layer_params),
        root_compute_bytes=int(act * _root_params(arch, s)),
        head_params=arch.lm_head_params or arch.embedding_params, trainable=int(P),
    )


def _frozen_base(arch: ModelArch, s: TrainSetup) -> tuple[float, float, int]:
    """(frozen base bytes FSDP may shard, quant_state bytes every GPU keeps, one block's compute bytes)."""
    base_elem = compute_bytes(s)  # frozen base as loaded
    layer_params = arch.layer_params()
    if s.task != "qlora":
        return base_elem * arch.params, 0.0, base_elem * layer_params
    linear = arch.layer_linear_params()
    quantized = arch.num_layers * linear
    packed = constants()["nf4"]["weight_bits"] / 8  # the 4-bit codes: the (bf16-storage) parameter FSDP shards
    # bitsandbytes keeps absmax + double-quant scales in Params4bit.quant_state, a Python attribute,
    # not a parameter: FSDP neither shards nor offloads it, so every GPU holds all of it.
    quant_state = (nf4_bytes_per_param() - packed) * quantized
    base = packed * quantized + base_elem * (arch.params - quantized)
    return base, quant_state, int(packed * linear) + base_elem * (layer_params - linear)


def _adapter_states(arch: ModelArch, s: TrainSetup, d: _Shards) -> Weights:
    L = arch.num_layers
    trainable = arch.lora_params(s.lora_rank, resolve_lora_targets(s.lora_targets))
    base_elem = compute_bytes(s)
    base, quant_state, layer_compute = _frozen_base(arch, s)
    # adapters train in the run's precision; peft's kbit preparation (and its autocast_adapter_dtype) keeps them fp32
    ad_elem = 2 if (s.precision == "bf16" and not kbit_fp32(s)) else 4
    layer_trainable = trainable // L
    layer_compute += compute_bytes(s) * layer_trainable
    d_base = 1 if (s.task == "qlora" and getattr(s, "qlora_base_replicated", False)) else d.param
    params = int(base) // d_base + int(quant_state) + ad_elem * trainable // d.param
    grads = ad_elem * trainable // d.grad
    if frozen_flat_grads(s):
        # torch FSDP1 docs (use_orig_params): mixing frozen and trainable parameters in one unit makes
        # gradient memory "equivalent to not freezing those parameters" -- for every block's flat param
        grads = (base_elem * L * arch.layer_params() + ad_elem * trainable) // d.grad
        layer_trainable = arch.layer_params() + layer_trainable
    opt = optimizer_bytes_per_param(s.optimizer, ad_elem) * trainable / d.opt
    return Weights(
        params=int(params), grads=int(grads), optimizer=int(opt), master=0,
        layer_compute_bytes=int(layer_compute), layer_trainable=int(layer_trainable),
        root_compute_bytes=int(base_elem * _root_params(arch, s)),
        head_params=arch.lm_head_params or arch.embedding_params, trainable=int(trainable),
        quant_state=int(quant_state),
    )


def model_states(arch: ModelArch, s: TrainSetup, shard: int) -> Weights:
    """Per-GPU parameters, gradients, optimizer states and master weights, CPU offload applied."""
    d = _shards(s, shard)
    w = _full_states(arch, s, d) if s.task == "full" else _adapter_states(arch, s, d)
    opt, master, params, grads = w.optimizer, w.master, w.params, w.grads
    if s.offload in ("optimizer", "full"):
        opt, master = 0, 0
    if s.offload == "full":
        params, grads = 0, 0
        if s.task == "qlora":
            params = w.quant_state  # not a parameter, so not offloaded either
    return Weights(
        params=params, grads=grads, optimizer=opt, master=master, layer_compute_bytes=w.layer_compute_bytes,
        layer_trainable=w.layer_trainable, root_compute_bytes=w.root_compute_bytes, head_params=w.head_params,
        trainable=w.trainable, quant_state=w.quant_state,
    )
