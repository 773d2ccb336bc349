"""Analytic per-GPU peak memory of one training setup, term by term.

What is modelled is what PyTorch actually holds, not a bytes-per-parameter rule:

* FSDP2 (`fully_shard`, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)) keeps fp32
  sharded parameters, fp32 sharded gradients and two fp32 AdamW states (16 B/param / shards);
  each decoder block is all-gathered to bf16 for compute (current + one prefetched), the root
  (embeddings, final norm, output head) stays unsharded from forward to backward, and backward
  reduce-scatters per block through an fp32 copy of the block's bf16 gradients.
* DDP / single GPU with torch.autocast: fp32 params, fp32 grads, AdamW states, plus the bf16
  weight copies autocast makes and autograd keeps for backward (the "18 bytes/param").
* ZeRO-1/2 (DeepSpeed bf16): bf16 params and grads, fp32 master + states partitioned.
* Pure bf16: params, grads and AdamW states all bf16 (8 B/param).
* LoRA / QLoRA: the frozen base has no gradients or optimizer state (bf16, or NF4 with double
  quantization for QLoRA's decoder linears); adapters train in the run's precision. bitsandbytes keeps
  the NF4 absmax/scales outside the parameters, so FSDP neither shards nor offloads them. LoRA dropout
  (PEFT/torchtune, p > 0) keeps a dropped-out copy of each adapted module's input plus a bool mask.
* The loss stack is a stated assumption (`loss_impl`): modern HF (compute-dtype logits kept by the loop
  through backward), legacy HF < 4.45 (fp32 logits + shifted copy, kept through backward and the
  step), or native loops that free the logits before backward (torchtitan, torchtune).

Activations are counted per token per layer from the tensors autograd saves in a Llama-style
block (RMSNorm, RoPE, SDPA/FlashAttention, GQA, SwiGLU), the approach of Korthikanti et al. 2022
without the s^2 attention term (FlashAttention never stores the score matrix). The peak is the
largest of three moments: the start of backward (every saved activation plus the loss buffers),
the backward of the top block (recomputation and activation gradients), and the optimizer step
(all gradients). Constants live in catalog/data/memory_constants.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuprov import validators as v
from gpuprov.catalog import load_data
from gpuprov.errors import GpuprovError
from gpuprov.sizing import parallel
from gpuprov.sizing.arch import ModelArch, check_lora_rank, resolve_lora_targets
from gpuprov.sizing.types import (
    AC_MODES,
    COMPILE_SCOPES,
    FSDP_VERSIONS,
    OFFLOADS,
    OPTIMIZERS,
    PRECISIONS,
    SHARDINGS,
    TASKS,
    MemoryEstimate,
    TrainSetup,
)

GIB = 2**30

# Breakdown term names, in display order (the precise estimator reuses them where they map).
TERMS: tuple[str, ...] = (
    "parameters",
    "gradients",
    "optimizer_states",
    "fp32_master",
    "gathered_params",
    "autocast_weight_cache",
    "reduce_scatter_buffers",
    "comm_buckets",
    "activations",
    "activation_transient",
    "logits",
    "cross_entropy",
    "optimizer_step_transient",
    "allocator_fragmentation",
    "nccl_buffers",
    "cuda_context",
)

# Terms that live outside PyTorch's caching allocator (not in torch.cuda.memory_reserved()).
NON_ALLOCATOR_TERMS: tuple[str, ...] = ("nccl_buffers", "cuda_context")


def _c() -> dict:
    return load_data("memory_constants.yaml")


@dataclass
class _Phase:
    name: str
    terms: dict[str, int] = field(default_factory=dict)

    def total(self) -> int:
        return sum(self.terms.values())


# The stack knobs now live on TrainSetup itself (framework presets are plain mappings of its fields);
# the old name stays for callers that import it.
ExtendedSetup = TrainSetup


# The software stack around the loss, a stated assumption (the estimate cannot see the user's code):
LOSS_IMPLS: dict[str, str] = {
    "hf": (
        "HF transformers >= 4.45 loss: compute-dtype logits in the model output, kept by the training loop"
        " through backward and the optimizer step; fp32 upcast + log-softmax inside the loss"
    ),
    "hf-legacy": (
        "HF transformers < 4.45 loss: LlamaForCausalLM returns logits.float() (fp32) and copies the shifted"
        " logits for the loss; the training loop keeps the fp32 logits through backward and the optimizer step"
    ),
    "native": (
        "logits freed by the training loop before backward (torchtitan `del pred`, torchtune `del logits`);"
        " fp32 upcast + log-softmax inside the loss"
    ),
}


# ---------------------------------------------------------------------------- validation


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise GpuprovError(f"{name} must be a positive integer, got {value!r}")
    return value


def _at_most(name: str, value: int, limit: int) -> None:
    """The spec's sanity bounds (gpuprov.validators) for `estimate` too: past them the arithmetic is
    meaningless (a 10^20-token sample), so say so instead of printing exabytes."""
    if value > limit:
        raise GpuprovError(f"{name} {value} is beyond any real run (at most {limit:,})")


def shard_group_size(setup: TrainSetup) -> int:
    """HSDP shard-group size: explicit, else the GPUs of one node (never more than all GPUs)."""
    group = setup.shard_group if setup.shard_group is not None else min(setup.gpus_per_node, setup.gpus)
    return group


def validate_setup(arch: ModelArch, setup: TrainSetup) -> None:
    _positive("--seq-len", setup.seq_len)
    _positive("--micro-batch", setup.micro_batch)
    _positive("--gpus", setup.gpus)
    _positive("GPUs per node", setup.gpus_per_node)
    _positive("--grad-accumulation", setup.grad_accumulation_steps)
    _at_most("--seq-len", setup.seq_len, v.MAX_SEQ_LEN)
    _at_most("--gpus", setup.gpus, v.MAX_GPUS)
    _at_most("--micro-batch x --seq-len", setup.micro_batch * setup.seq_len, v.MAX_BATCH_TOKENS)
    _at_most("--grad-accumulation", setup.grad_accumulation_steps, v.MAX_BATCH_TOKENS)
    for name, value, allowed in (
        ("--task", setup.task, TASKS),
        ("--sharding", setup.sharding, SHARDINGS),
        ("--activation-checkpointing", setup.activation_checkpointing, AC_MODES),
        ("--precision", setup.precision, PRECISIONS),
        ("--optimizer", setup.optimizer, OPTIMIZERS),
        ("--offload", setup.offload, OFFLOADS),
        ("--compile-scope", setup.compile_scope, COMPILE_SCOPES),
        ("--fsdp-version", setup.fsdp_version, FSDP_VERSIONS),
    ):
        if value not in allowed:
            raise GpuprovError(f"{name} {value!r} is not one of {', '.join(map(str, allowed))}")
    if setup.task in ("lora", "qlora"):
        _positive("--lora-rank", setup.lora_rank)
        check_lora_rank(arch, setup.lora_rank)
        resolve_lora_targets(setup.lora_targets)
    if setup.shard_group is not None:
        _positive("--shard-group", setup.shard_group)
    if setup.sharding == "hsdp":
        group = shard_group_size(setup)
        if group > setup.gpus or setup.gpus % group:
            raise GpuprovError(
                f"hsdp shard group of {group} GPUs does not divide {setup.gpus} GPUs; "
                f"pick --shard-group among the divisors of {setup.gpus}"
            )


# ---------------------------------------------------------------------------- weights


def nf4_bytes_per_param() -> float:
    nf4 = _c()["nf4"]
    absmax = nf4["double_quant_absmax_bytes"] / nf4["blocksize"]
    scales = nf4["double_quant_scale_bytes"] / (nf4["blocksize"] * nf4["double_quant_blocksize"])
    return nf4["weight_bits"] / 8 + absmax + scales


def _optimizer_bytes_per_param(optimizer: str, state_elem_bytes: int) -> float:
    if optimizer == "adamw-8bit":
        q = _c()["adamw_8bit"]
        return 2 * (q["state_bytes"] + q["absmax_bytes"] / q["blocksize"])
    return 2 * state_elem_bytes  # AdamW exp_avg + exp_avg_sq, in the parameter's dtype


@dataclass(frozen=True)
class _Weights:
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


def _loss_compiled(s: TrainSetup) -> bool:
    """The loss itself compiled: with the whole model, or apart (torchtune compile_loss). Per-block
    compile alone (torchtitan, gpuprov's trainer) leaves the loss eager."""
    return s.compile and (s.compile_scope == "model" or s.compile_loss)


def autocast_fp32(s: TrainSetup) -> bool:
    """bf16 compute by torch.autocast over fp32 parameters: always so for bf16-mixed full training
    without sharding (DDP / one GPU); under FSDP/ZeRO or for LoRA only where the stack says so."""
    return s.precision == "bf16-mixed" and bool(s.autocast_fp32_params)


def float8_gather(s: TrainSetup) -> bool:
    """torchao float8 with FSDP2 float8 all-gather (full training: the float8 linears are trainable)."""
    return bool(s.float8) and s.task == "full" and s.sharding in ("fsdp", "hsdp") and s.fsdp_version == 2


def unsharded_accumulation(s: TrainSetup) -> bool:
    return bool(s.defer_grad_sync) and s.grad_accumulation_steps > 1 and s.sharding in ("fsdp", "hsdp")


def frozen_flat_grads(s: TrainSetup) -> bool:
    return bool(s.fsdp1_frozen_grads) and s.fsdp_version == 1 and s.task == "lora" and s.sharding in ("fsdp", "hsdp")


def _weights(arch: ModelArch, s: TrainSetup, n_gpus: int, shard: int) -> _Weights:
    P = arch.params
    L = arch.num_layers
    fp32_store = autocast_fp32(s)
    act = 4 if (s.precision == "fp32" or fp32_store) else 2  # the dtype FSDP gathers a block in
    layer_params = arch.layer_params()
    root_params = P - L * layer_params
    if s.shard_embeddings and arch.lm_head_params:
        # embeddings are their own FSDP unit, resharded after forward: only the head (+ final norm) is
        # gathered at the start of backward (torchtitan fsdp.py, torchtune custom_sharded_layers)
        root_params -= arch.embedding_params
    head_params = arch.lm_head_params or arch.embedding_params
    fsdp = s.sharding in ("fsdp", "hsdp")
    zero = s.sharding in ("zero1", "zero2")
    d_param = shard if fsdp else 1
    d_grad = shard if (fsdp or s.sharding == "zero2") else 1
    if fsdp and unsharded_accumulation(s):
        # FSDP1 no_sync() accumulates "the full model gradients (instead of gradient shards)"; FSDP2 without
        # gradient sync keeps FSDPParam.unsharded_accumulated_grad in the reduce dtype
        d_grad = 1
    d_opt = shard if (fsdp or zero) else 1

    if s.task == "full":
        trainable = P
        if s.precision == "bf16-mixed" and zero:
            # DeepSpeed bf16: bf16 params/grads, fp32 master and fp32 gradient partitions.
            params = 2 * P
            grads = 2 * P // d_grad + 4 * P // d_opt
            master = 4 * P // d_opt
            opt = _optimizer_bytes_per_param(s.optimizer, 4) * P / d_opt
        else:
            elem = 2 if s.precision == "bf16" else 4  # bf16-mixed keeps fp32 params (FSDP2 / AMP)
            params = elem * P // d_param
            grads = elem * P // d_grad
            master = 0
            opt = _optimizer_bytes_per_param(s.optimizer, elem) * P / d_opt
        layer_compute = act * layer_params
        if float8_gather(s):
            # the linears' weights are cast to float8 before the all-gather and held so (torchao
            # WeightWithDynamicFloat8CastTensor); norms stay in the compute dtype, the root is not float8
            linear = arch.layer_linear_params()
            layer_compute = _c()["float8"]["gather_bytes"] * linear + act * (layer_params - linear)
        root_compute = act * root_params
        layer_trainable = layer_params
    else:
        targets = resolve_lora_targets(s.lora_targets)
        trainable = arch.lora_params(s.lora_rank, targets)
        base_elem = 4 if (s.precision == "fp32" or fp32_store) else 2  # frozen base as loaded
        quant_state = 0.0
        if s.task == "qlora":
            quantized = L * arch.layer_linear_params()
            packed = _c()["nf4"]["weight_bits"] / 8  # the 4-bit codes: the (bf16-storage) parameter FSDP shards
            # bitsandbytes keeps absmax + double-quant scales in Params4bit.quant_state, a Python attribute,
            # not a parameter: FSDP neither shards nor offloads it, so every GPU holds all of it.
            quant_state = (nf4_bytes_per_param() - packed) * quantized
            base = packed * quantized + base_elem * (P - quantized)
            layer_compute = int(packed * arch.layer_linear_params()) + base_elem * (
                layer_params - arch.layer_linear_params()
            )
        else:
            base = base_elem * P
            layer_compute = base_elem * layer_params
        ad_elem = 2 if s.precision == "bf16" else 4
        layer_trainable = trainable // L
        layer_compute += act * layer_trainable
        d_base = 1 if (s.task == "qlora" and getattr(s, "qlora_base_replicated", False)) else d_param
        params = int(base) // d_base + int(quant_state) + ad_elem * trainable // d_param
        grads = ad_elem * trainable // d_grad
        if frozen_flat_grads(s):
            # torch FSDP1 docs (use_orig_params): mixing frozen and trainable parameters in one unit makes
            # gradient memory "equivalent to not freezing those parameters" -- for every block's flat param
            grads = (base_elem * L * layer_params + ad_elem * trainable) // d_grad
            layer_trainable = layer_params + layer_trainable
        master = 0
        opt = _optimizer_bytes_per_param(s.optimizer, ad_elem) * trainable / d_opt
        root_compute = base_elem * root_params

    if s.offload in ("optimizer", "full"):
        opt, master = 0, 0
    if s.offload == "full":
        params, grads = 0, 0
        if s.task == "qlora":
            params = int(quant_state)  # not a parameter, so not offloaded either
    return _Weights(
        params=int(params),
        grads=int(grads),
        optimizer=int(opt),
        master=int(master),
        layer_compute_bytes=int(layer_compute),
        layer_trainable=int(layer_trainable),
        root_compute_bytes=int(root_compute),
        head_params=head_params,
        trainable=int(trainable),
    )


# ---------------------------------------------------------------------------- activations


def _kv_as_attended(arch: ModelArch) -> int:
    """K/V width fed to SDPA: GQA heads are repeated (repeat_kv copies) to the query heads."""
    return arch.q_dim if arch.num_kv_heads < arch.num_attention_heads else arch.kv_dim


def _norms_per_layer(arch: ModelArch) -> int:
    return 4 if arch.model_type == "gemma2" else 2


def layer_activation_bytes_per_token(arch: ModelArch, a: int, compiled: bool, lora_rank_sum: int = 0) -> int:
    """Bytes one token leaves saved for backward in one decoder block, no checkpointing."""
    h, q, f = arch.hidden_size, arch.q_dim, arch.intermediate_size
    kv = _kv_as_attended(arch)
    if compiled:
        norm = 2 * a * h  # fused: input and output only
    else:
        norm = 4 * h + 2 * a * h  # eager: fp32 upcast copy + normalized + weighted output
    attn = a * (q + 2 * kv + q + q) + 4 * arch.num_attention_heads  # q_rot, k, v, out, o_proj input, lse
    mlp_dense = (3 if compiled else 4) * a * f  # gate, up, (silu), product
    if arch.is_moe:
        k = arch.experts_per_token
        mlp = k * (mlp_dense + 2 * a * h) + 4 * arch.num_experts * 2  # routed copies + router probs
    else:
        mlp = mlp_dense
    lora = a * lora_rank_sum  # adapters' A outputs
    return _norms_per_layer(arch) * norm + attn + mlp + lora


def lora_dropout_bytes_per_token(arch: ModelArch, a: int, targets: tuple[str, ...]) -> int:
    """PEFT/torchtune LoRA with dropout > 0: every adapted module drops out its own copy of its input
    (nn.Dropout per module) and autograd keeps that copy (input of lora_A) and the bool mask."""
    shapes = arch.linear_shapes()
    k = arch.experts_per_token if arch.is_moe else 1
    width = sum(shapes[t][0] * (k if shapes[t][2] > 1 else 1) for t in targets)
    return (a + _c()["lora_dropout"]["mask_bytes"]) * width


def _biased(arch: ModelArch, name: str) -> bool:
    if name in ("q_proj", "k_proj", "v_proj"):
        return arch.attention_bias or arch.qkv_bias
    if name == "o_proj":
        return arch.attention_bias
    return arch.mlp_bias


def selective_layer_bytes_per_token(
    arch: ModelArch, a: int, lora_targets: tuple[str, ...] = (), lora_rank: int = 0
) -> int:
    """torchtitan op-level SAC: keeps the block input, every other matmul output and SDPA out.

    The policy counts `aten.mm` calls inside each block and saves the odd-numbered ones, so what
    is kept depends on the op sequence: a LoRA-adapted linear issues three (base, lora_A, lora_B),
    which shifts the parity and keeps about twice the matmul outputs of full training; a linear
    with a bias runs as `addmm`, which the policy neither counts nor saves.
    """
    h, q = arch.hidden_size, arch.q_dim
    if arch.is_moe:
        mlp = a * arch.intermediate_size * arch.experts_per_token
        return a * (h + q + arch.kv_dim + q + h) + mlp + 4 * arch.num_attention_heads
    count = saved = 0
    for name, (_, out_features, _) in arch.linear_shapes().items():  # forward order
        outputs = [] if _biased(arch, name) else [out_features]
        if name in lora_targets:
            outputs += [lora_rank, out_features]  # lora_A, lora_B (no bias)
        for width in outputs:
            count += 1
            saved += width if count % 2 == 1 else 0
    return a * (h + q + saved) + 4 * arch.num_attention_heads  # block input, SDPA out (+ lse)


def autocast_extra_bytes_per_token(arch: ModelArch, lora_targets: tuple[str, ...] = ()) -> int:
    """Extra bytes one token leaves per block when autocast runs over fp32 parameters.

    The residual stream is fp32 (embedding output and every residual add stay fp32), so each RMSNorm
    keeps an fp32 `.to(input_dtype)` copy (+2 B x hidden) and hands an fp32 output to its linears:
    autocast casts it to bf16 once per consuming linear and autograd saves every cast (q, k, v; gate,
    up; and each LoRA A on them) where a bf16 stack saves one shared bf16 tensor.
    """
    h = arch.hidden_size
    norms = _norms_per_layer(arch)
    consumers = {"attn": ["q_proj", "k_proj", "v_proj"], "mlp": ["gate_proj", "up_proj"]}
    extra_casts = sum(len(mods) - 1 + sum(1 for m in mods if m in lora_targets) for mods in consumers.values())
    return 2 * h * norms + 2 * h * extra_casts


def _grad_work_bytes_per_token(arch: ModelArch, a: int) -> int:
    """Activation gradients alive while one block runs backward (MLP-wide plus residual)."""
    k = arch.experts_per_token if arch.is_moe else 1
    return a * (2 * arch.intermediate_size * k + 2 * arch.hidden_size)


# ---------------------------------------------------------------------------- estimate


def estimate_memory(arch: ModelArch, setup: TrainSetup, gpu_memory_bytes: int | None = None) -> MemoryEstimate:
    """Predicted peak bytes on the busiest GPU, with every term and the assumptions behind it."""
    validate_setup(arch, setup)
    parallel.validate(arch, setup)
    s = setup
    c = _c()
    n = s.gpus
    fsdp = s.sharding in ("fsdp", "hsdp")
    shard = parallel.fsdp_degree(s, shard_group_size(s) if s.sharding == "hsdp" else n)
    a = 4 if s.precision == "fp32" else 2
    tokens = s.seq_len * s.micro_batch
    L = arch.num_layers
    w = _weights(arch, s, n, shard)
    lora_rank_sum = 0
    if s.task != "full":
        lora_rank_sum = s.lora_rank * len(resolve_lora_targets(s.lora_targets))
    act_offload = bool(s.activation_offloading)
    grad_accum = int(s.grad_accumulation_steps or 1)
    fp32_autocast = autocast_fp32(s)
    whole_compile = s.compile and s.compile_scope == "model"
    adapted = resolve_lora_targets(s.lora_targets) if s.task != "full" else ()

    # -- activations saved across the whole forward --------------------------------------
    full_layer = layer_activation_bytes_per_token(arch, a, s.compile, lora_rank_sum)
    if fp32_autocast:
        full_layer += autocast_extra_bytes_per_token(arch, adapted)
    resid = 4 if fp32_autocast else a  # the residual stream (a block's input) dtype
    lora_dropout = float(getattr(s, "lora_dropout", 0.0) or 0.0)
    if s.task != "full" and lora_dropout > 0:
        full_layer += lora_dropout_bytes_per_token(arch, a, resolve_lora_targets(s.lora_targets))
    if s.activation_checkpointing == "none":
        saved_layer = full_layer
        recompute = 0
    elif s.activation_checkpointing == "selective":
        lora_targets = resolve_lora_targets(s.lora_targets) if s.task != "full" else ()
        saved_layer = selective_layer_bytes_per_token(arch, a, lora_targets, s.lora_rank)
        saved_layer += (resid - a) * arch.hidden_size
        recompute = max(full_layer - saved_layer, 0)
    else:
        saved_layer = resid * arch.hidden_size
        recompute = full_layer - saved_layer
    # the final RMSNorm runs eager unless the whole model is compiled
    final_norm = 2 * a * arch.hidden_size if whole_compile else 4 * arch.hidden_size + 2 * a * arch.hidden_size
    if fp32_autocast:
        final_norm += 2 * arch.hidden_size
    if act_offload:
        # Offloaded activations stream to host; roughly two blocks stay resident (current + in flight).
        saved_all = tokens * (saved_layer * min(L, 2)) + tokens * final_norm
    else:
        saved_all = tokens * (saved_layer * L + final_norm)
    layer_transient = tokens * (recompute + _grad_work_bytes_per_token(arch, a))
    if s.task == "qlora":
        h, f = arch.hidden_size, arch.intermediate_size
        layer_transient += 2 * h * max(f, arch.q_dim)  # one linear dequantized to bf16 at a time
    if fp32_autocast and s.activation_checkpointing != "none":
        layer_transient += 2 * arch.layer_linear_params()  # the recomputed block's bf16 weight casts

    # -- logits and loss -------------------------------------------------------------------
    ce = c["cross_entropy"]
    V = arch.vocab_size
    loss_impl = getattr(s, "loss_impl", "hf")
    if loss_impl not in LOSS_IMPLS:
        raise GpuprovError(f"loss implementation {loss_impl!r} is not one of {', '.join(LOSS_IMPLS)}")
    legacy = loss_impl == "hf-legacy" and not s.chunked_cross_entropy
    # fp32 model output: transformers < 4.45, or torchtune's unembed `.float()` (its chunked output stays bf16)
    fp32_out = legacy or (s.fp32_logits and not s.chunked_cross_entropy)
    logits_elem = c["loss_impl"]["legacy_logits_bytes"] if fp32_out else a
    logits = tokens * logits_elem * V  # the model output, held by the caller at least until backward starts
    if arch.model_type == "gemma2":
        logits += tokens * a * V  # final logit soft-capping saves the tanh output too
    chunks = ce["chunks"]
    # log-softmax and its gradient in fp32, or in the logits' dtype; under autocast log_softmax runs in fp32
    amp = fp32_autocast or (s.precision == "bf16-mixed" and s.sharding in ("none", "ddp"))
    ce_elem = 4 if (s.loss_upcast or amp) else a
    loss_compiled = _loss_compiled(s)
    if s.chunked_cross_entropy and loss_compiled:
        ce_bytes = tokens * ce_elem * V // chunks  # fused per-chunk loss: one chunk's gradient at a time
    elif s.chunked_cross_entropy:
        ce_bytes = tokens * ce_elem * V + tokens * ce_elem * V * 2 // chunks
    elif loss_compiled:
        # the loss is inside the compiled graph: inductor saves the logits and the logsumexp and writes
        # the logits' gradient in one fused kernel (softmax - one-hot), no log-softmax buffer
        ce_bytes = tokens * ce_elem * V * ce["fp32_buffers_compiled"]
    else:
        ce_bytes = tokens * ce_elem * V * ce["fp32_buffers_eager"]
    # Logits the training loop still references after the loss (HF loops keep `outputs` until after
    # the optimizer step; litgpt keeps its list of chunked logits through backward); torchtitan and
    # torchtune free them before backward.
    held_logits = 0 if loss_impl == "native" else logits
    # At the start of backward an eager loss has saved only its fp32 log-softmax (the upcast and the model's
    # logits are not saved by autograd), so logits a loop deleted are gone; a fused (compiled) loss saves
    # its input logits and rebuilds the softmax in backward.
    fused_loss = loss_compiled
    logits_at_backward = logits if (loss_impl != "native" or fused_loss) else 0

    # -- FSDP gathered blocks and reduce-scatter staging ------------------------------------
    gathered = 0
    rs_buffers = 0
    if fsdp or s.offload == "full":
        units = 1 + c["fsdp"]["prefetch_units"]
        gathered = units * w.layer_compute_bytes + w.root_compute_bytes
        if s.offload == "full" and fsdp:
            # FSDP1 CPUOffload: each unit's CPU shard is first copied to the GPU (a new tensor, freed at
            # reshard), then all-gathered (torch.distributed.fsdp._flat_param.pre_unshard)
            gathered += units * w.layer_compute_bytes // shard
        reduce_elem = 4 if s.precision in ("bf16-mixed", "fp32") else 2
        if s.fsdp_version == 1 and s.precision != "fp32":
            reduce_elem = 2  # FSDP1 MixedPrecision as accelerate/Lightning build it: reduce_dtype bf16
        grad_elem = 4 if fp32_autocast else a  # the unsharded gradient is in the gathered dtype
        rs_buffers = w.layer_trainable * (grad_elem + reduce_elem) + w.layer_trainable * reduce_elem // shard
        if s.fsdp_version == 1 and fsdp and not fp32_autocast and s.precision == "bf16-mixed":
            # FSDP1 MixedPrecision first casts each unit's fp32 shard to a bf16 `_mp_shard`, then all-gathers
            # it into the padded flat parameter (torch/distributed/fsdp/_flat_param.py _use_low_precision_shard)
            gathered += units * w.layer_compute_bytes // shard
    autocast_cache = 0
    if s.precision == "bf16-mixed" and s.task == "full" and s.sharding in ("none", "ddp") and s.offload != "full":
        autocast_cache = 2 * arch.params  # bf16 weight casts kept by autograd until each backward
    elif fp32_autocast:
        autocast_cache = _autocast_weight_casts(arch, s)

    # -- gradients held during forward/backward ---------------------------------------------
    comm_buckets = 0
    if s.sharding == "ddp":
        comm_buckets = w.grads  # DDP flat buckets duplicate the gradients
    elif s.sharding in ("zero1", "zero2"):
        bucket = c["zero_buckets"]["elements"] * a
        comm_buckets = min(2 * bucket, 2 * a * w.trainable)
    # FSDP's sharded grads sit in the reduce-scatter stream's cached blocks; DDP/ZeRO keep them;
    # with gradient accumulation every setup keeps them between micro-batches.
    grads_during_fwd = w.grads if (s.sharding != "none" or grad_accum > 1) else 0
    head_grad = 0
    head_elem = 4 if fp32_autocast else a
    if s.task == "full" and grads_during_fwd == 0:
        head_grad = head_elem * w.head_params  # the output head's gradient appears first in backward
    elif s.task == "full" and fsdp:
        head_grad = head_elem * w.head_params  # unsharded grad of the root until its reduce-scatter

    base = {
        "parameters": w.params,
        "optimizer_states": w.optimizer,
        "fp32_master": w.master,
        "comm_buckets": comm_buckets,
    }
    phase_a = _Phase("start of backward (loss)", {
        **base,
        "gradients": grads_during_fwd,
        "gathered_params": gathered,
        "autocast_weight_cache": autocast_cache,
        "reduce_scatter_buffers": rs_buffers,
        "activations": saved_all,
        "logits": logits_at_backward,
        "cross_entropy": ce_bytes,
    })
    phase_b = _Phase("backward of the last block", {
        **base,
        "gradients": grads_during_fwd + head_grad,
        "gathered_params": gathered,
        "autocast_weight_cache": autocast_cache,
        "reduce_scatter_buffers": rs_buffers,
        "activations": saved_all - tokens * final_norm,
        "activation_transient": layer_transient,
        "logits": held_logits,
    })
    step_transient = 0  # fused AdamW: no per-step temporaries
    impl = getattr(s, "optimizer_impl", "fused")
    if impl not in ("fused", "foreach"):
        raise GpuprovError(f"optimizer implementation {impl!r} is not one of fused, foreach")
    if impl == "foreach" and s.optimizer == "adamw" and s.offload == "none":
        # torch._foreach_sqrt(exp_avg_sqs) materialises one state-sized list before addcdiv_
        step_transient = w.optimizer // 2
    phase_c = _Phase("optimizer step", {
        **base,
        "gradients": w.grads,
        "gathered_params": gathered if fsdp else 0,
        "optimizer_step_transient": step_transient,
        "logits": held_logits,
    })
    peak = max(parallel.apply(arch, s, [phase_a, phase_b, phase_c], tokens, a), key=_Phase.total)

    terms = {t: 0 for t in TERMS}
    terms.update(peak.terms)

    # Cached-but-unusable blocks: freed tensors whose blocks belong to another stream or do not fit
    # the next request (eager mode frees many odd-sized intermediates; compile fuses them away).
    alloc = c["allocator"]
    frac = alloc["fragmentation_compiled"] if s.compile else alloc["fragmentation_eager"]
    terms["allocator_fragmentation"] = int(sum(terms.values()) * frac)
    nc = c["nccl"]
    if n > 1:
        terms["nccl_buffers"] = int(nc["buffsize_bytes"] * nc["channels"] * nc["connections_per_channel"] * nc["protocol_factor"])
        terms["nccl_buffers"] *= parallel.communicators(s)
    terms["cuda_context"] = int(c["cuda_context"]["bytes"])
    terms = {k: int(v) for k, v in terms.items()}
    per_gpu = sum(terms.values())

    assumptions = _assumptions(arch, s, peak.name, fsdp, shard, grad_accum, act_offload)
    assumptions.extend(_stack_assumptions(arch, s, fsdp))
    if gpu_memory_bytes is not None:
        free = gpu_memory_bytes - per_gpu
        verdict = "fits" if free >= 0 else "does not fit"
        assumptions.append(f"{verdict} in {gpu_memory_bytes / GIB:.1f} GiB with {free / GIB:+.1f} GiB to spare")
    states = (w.params + w.grads + w.optimizer + w.master) * n // parallel.layout(s).model_shards
    return MemoryEstimate(
        per_gpu_bytes=per_gpu,
        breakdown=terms,
        model_states_bytes=int(states),
        trainable_params=w.trainable,
        assumptions=tuple(assumptions),
    )


def _autocast_weight_casts(arch: ModelArch, s: TrainSetup) -> int:
    """bf16 casts of fp32 weights that autograd saves under autocast (FSDP1 parameters are views of the
    flat parameter, not leaves, so autocast's cast cache never holds them; every matmul saves its own).
    Without AC every block's casts live until its backward; with AC a block recomputes its casts in
    backward, so only the output head's cast is held from forward to backward."""
    head = 2 * (arch.lm_head_params or arch.embedding_params)
    if s.activation_checkpointing != "none":
        return head
    return 2 * arch.num_layers * arch.layer_linear_params() + head


def allocator_bytes(estimate: MemoryEstimate, gpu_memory_bytes: int | None = None) -> dict[str, int]:
    """What PyTorch's own counters would read: `reserved` and `active` (live tensors).

    Given the GPU's memory, `reserved` cannot exceed what is left beside the CUDA context and NCCL:
    when cudaMalloc fails the caching allocator releases its unused cached blocks and retries
    (CUDACachingAllocator malloc -> release_cached_blocks), so near a full GPU the fragmentation
    is given back rather than read as reserved. `per_gpu_bytes` keeps the full fragmentation term
    as the planning margin."""
    outside = sum(estimate.breakdown.get(t, 0) for t in NON_ALLOCATOR_TERMS)
    reserved = estimate.per_gpu_bytes - outside
    active = reserved - estimate.breakdown.get("allocator_fragmentation", 0)
    if gpu_memory_bytes is not None:
        reserved = max(active, min(reserved, gpu_memory_bytes - outside))
    return {"reserved": reserved, "active": active}


def _assumptions(
    arch: ModelArch, s: TrainSetup, peak: str, fsdp: bool, shard: int, grad_accum: int, act_offload: bool
) -> list[str]:
    out = [f"peak at the {peak}"]
    if s.task == "full":
        states = {
            ("bf16-mixed", True): "FSDP2 bf16-mixed: fp32 sharded params + fp32 sharded grads + 2 fp32 AdamW states, bf16 all-gathered blocks, fp32 reduce-scatter",
            ("bf16", True): "FSDP2 pure bf16: params, grads and AdamW states all bf16, sharded",
            ("fp32", True): "FSDP2 fp32: params, grads and AdamW states fp32, sharded",
        }
        if fsdp:
            out.append(states[(s.precision, True)])
        elif s.sharding in ("zero1", "zero2") and s.precision == "bf16-mixed":
            out.append("ZeRO (DeepSpeed bf16): bf16 params and grads, fp32 master + fp32 grad partition + AdamW states partitioned")
        elif s.precision == "bf16-mixed":
            out.append("torch.autocast bf16: fp32 params, fp32 grads, fp32 AdamW states, and bf16 weight casts kept for backward (18 B/param)")
        else:
            out.append(f"{s.precision}: params, grads and AdamW states in {s.precision.replace('-mixed', '')}")
    else:
        base = "NF4 (blocksize 64, double-quantized absmax) decoder linears, bf16 embeddings/head" if s.task == "qlora" else "bf16 frozen base"
        if s.task == "qlora" and getattr(s, "qlora_base_replicated", False):
            base += ", replicated on every GPU"
        elif s.sharding in ("fsdp", "hsdp"):
            base += ", sharded by FSDP"
        out.append(f"{s.task}: {base}; only adapters (rank {s.lora_rank}) have gradients and optimizer state")
    if s.sharding == "hsdp":
        out.append(f"hsdp: sharded within groups of {shard} GPUs, replicated across {s.gpus // shard} groups")
    if s.optimizer == "adamw-8bit":
        out.append("bitsandbytes 8-bit AdamW: 2 B/param of state + blockwise absmax")
    else:
        if getattr(s, "optimizer_impl", "fused") == "foreach":
            out.append("foreach AdamW (PyTorch's default): one optimizer-state-sized temporary at the step")
        else:
            out.append("fused AdamW (torch.optim.AdamW(fused=True)); foreach AdamW would add one state-sized temporary at the step")
    if s.offload != "none":
        out.append(f"CPU offload of {'optimizer states' if s.offload == 'optimizer' else 'params, grads and optimizer states'}")
    if s.offload == "full" and fsdp:
        out.append("FSDP CPU offload: each unit's shard is copied to the GPU, then all-gathered (current + prefetched unit, plus the root kept from forward to backward)")
    attn = "SDPA/FlashAttention (no s^2 scores stored), GQA K/V repeated to the query heads"
    if arch.model_type == "gemma2":
        attn += "; gemma2 attention soft-capping needs flash-attn >= 2.6 for this (eager attention would store s^2 scores)"
    out.append(attn)
    ac = {
        "none": "no activation checkpointing: every block's saved tensors live until its backward",
        "selective": "selective AC = torchtitan op-level SAC (keep block input, every other matmul output, SDPA output; recompute the rest)",
        "full": "full AC: only each block's input is kept; one block is recomputed at a time in backward",
    }[s.activation_checkpointing]
    out.append(ac)
    out.append("torch.compile per block (fused norms/SiLU intermediates)" if s.compile else "eager mode (RMSNorm fp32 upcast intermediates are saved)")
    if float8_gather(s):
        out.append("torchao float8 linears with FSDP2 float8 all-gather: each block's linear weights gathered and held "
                   "at 1 B/param; saved activations stay bf16 (torchao saves the high-precision input)")
    if s.chunked_cross_entropy:
        chunks = _c()["cross_entropy"]["chunks"]
        loss_compiled = _loss_compiled(s)
        out.append(f"chunked cross-entropy ({chunks} chunks, fp32 upcast per chunk), loss "
                   + ("compiled (one chunk's fused gradient at a time)" if loss_compiled
                      else f"eager ({arch.vocab_size} vocab: every chunk's fp32 log-softmax kept for backward)"))
    else:
        impl = getattr(s, "loss_impl", "hf")
        held = "fp32" if impl == "hf-legacy" else "compute-dtype"
        out.append(
            f"loss stack {impl!r}: {LOSS_IMPLS[impl]} ({arch.vocab_size} vocab: {held} logits + 3 fp32 logit-sized"
            " buffers at the start of backward); other choices: " + ", ".join(k for k in LOSS_IMPLS if k != impl)
        )
    if s.task != "full" and float(getattr(s, "lora_dropout", 0.0) or 0.0) > 0:
        out.append("LoRA dropout > 0: each adapted module keeps its dropped-out input copy and a bool mask for backward")
    if s.task == "qlora":
        out.append("bitsandbytes NF4: absmax/double-quant scales (quant_state) are not parameters, so every GPU keeps them whole (not sharded, not offloaded)")
    if act_offload:
        out.append("activations offloaded to CPU (about two blocks resident)")
    if grad_accum > 1 or s.sharding != "none":
        out.append("gradients held through forward (gradient accumulation / comm buffers / FSDP reduce-scatter stream cache)")
    else:
        out.append("no gradient accumulation: zero_grad(set_to_none=True) frees gradients before forward")
    frag = _c()["allocator"]["fragmentation_compiled" if s.compile else "fragmentation_eager"]
    out.append(
        f"PyTorch caching allocator: +{frag:.0%} over live tensors for fragmentation (reserved vs allocated);"
        " CUDA context and NCCL buffers outside it; near a full GPU the allocator frees its cache and retries,"
        " so torch.cuda.max_memory_reserved() reads at most the GPU's memory less context and NCCL"
    )
    out.append("weights loaded sharded (meta-device init + sharded load); loaders that first put the whole model on every GPU need more at start-up")
    out.extend(parallel.assumptions(arch, s))
    return out


def _stack_assumptions(arch: ModelArch, s: TrainSetup, fsdp: bool) -> list[str]:
    """What the stack knobs (framework presets) changed, one line each where they apply."""
    out = []
    if fsdp:
        out.append(
            "FSDP1 (FullyShardedDataParallel, flat parameters; the root unit holds embeddings + head)" if s.fsdp_version == 1
            else "FSDP2 (fully_shard, per-parameter DTensor shards)"
        )
    if autocast_fp32(s):
        out.append(
            "torch.autocast over fp32 parameters (no FSDP mixed-precision policy): fp32 weights"
            + (" and fp32 all-gathers" if fsdp else "") + "; fp32 residual stream, norms and embeddings;"
            " each linear saves its own bf16 casts of input and weight"
        )
    if s.compile:
        out.append("torch.compile of the whole model (loss fused into the graph, final norm fused)"
                   if s.compile_scope == "model" else "torch.compile per decoder block, final norm eager, loss "
                   + ("compiled apart (fused softmax - one-hot gradient)" if s.compile_loss else "eager"))
    if not s.loss_upcast:
        out.append("loss on the logits' dtype (no fp32 upcast before log-softmax)")
    if frozen_flat_grads(s):
        out.append("FSDP1 flat parameters mix the frozen base and the adapters (use_orig_params=True): gradients are allocated for the whole block, frozen weights included")
    if unsharded_accumulation(s):
        out.append("gradient accumulation without gradient sync (FSDP1 no_sync / FSDP2 set_requires_gradient_sync(False)): the full unsharded gradients stay on every GPU until the synchronising micro-batch")
    if s.shard_embeddings and fsdp:
        out.append("embeddings and output head sharded as FSDP units of their own (only the head is gathered at the start of backward)")
    return out
