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
without the s^2 attention term (FlashAttention never stores the score matrix). The one s^2 tensor a
run may hold is a per-document mask (gpuprov's trainer on packed data with SDPA): the boolean mask and
SDPA's additive copy of it are terms of their own (activations.document_masks). The peak is the
largest of three moments: the start of backward (every saved activation plus the loss buffers),
the backward of the top block (recomputation and activation gradients), and the optimizer step
(all gradients). Constants live in catalog/data/memory_constants.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuprov import validators as v
from gpuprov.errors import GpuprovError
from gpuprov.sizing import idle_cache, memory_notes, parallel
from gpuprov.sizing.activations import (  # noqa: F401 - re-exported: callers size tokens with them
    LOSS_IMPLS,
    autocast_extra_bytes_per_token,
    layer_activation_bytes_per_token,
    lora_dropout_bytes_per_token,
    selective_layer_bytes_per_token,
)
from gpuprov.sizing import activations as act
from gpuprov.sizing.arch import ModelArch, check_lora_rank, resolve_lora_targets
from gpuprov.sizing.memory_weights import (  # noqa: F401 - re-exported
    Weights,
    autocast_fp32,
    kbit_fp32,
    constants,
    float8_gather,
    frozen_flat_grads,
    model_states,
    nf4_bytes_per_param,
    pipeline_keeps_stage,
    unsharded_accumulation,
)
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
    "document_mask",
    "attention_bias",
    "logits",
    "cross_entropy",
    "optimizer_step_transient",
    "allocator_fragmentation",
    "nccl_buffers",
    "cuda_context",
)

# Terms that live outside PyTorch's caching allocator (not in torch.cuda.memory_reserved()).
NON_ALLOCATOR_TERMS: tuple[str, ...] = ("nccl_buffers", "cuda_context")


@dataclass
class _Phase:
    """The memory terms alive at one moment of a training step."""
    name: str
    terms: dict[str, int] = field(default_factory=dict)

    def total(self) -> int:
        return sum(self.terms.values())


# The stack knobs now live on TrainSetup itself (framework presets are plain mappings of its fields);
# the old name stays for callers that import it.
ExtendedSetup = TrainSetup


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




# ---------------------------------------------------------------------------- per-GPU buffers


@dataclass(frozen=True)
class _Ctx:
    """What every term of one estimate reads: the setup and the numbers derived from it once."""

    arch: ModelArch
    s: TrainSetup
    w: Weights
    shard: int  # FSDP/ZeRO shard degree after TP and PP took their ranks
    a: int  # bytes of a compute element (activations, gathered blocks)
    tokens: int  # tokens of one micro-batch on this GPU before TP/CP split them

    @property
    def fsdp(self) -> bool:
        return self.s.sharding in ("fsdp", "hsdp")


def _gathered(x: _Ctx) -> tuple[int, int]:
    """(FSDP's gathered blocks + root, reduce-scatter staging of one block's gradients)."""
    s, w = x.s, x.w
    if not (x.fsdp or s.offload == "full"):
        return 0, 0
    fp32_autocast = autocast_fp32(s)
    units = 1 + constants()["fsdp"]["prefetch_units"]
    if pipeline_keeps_stage(s):
        units = x.arch.num_layers  # every block stays gathered (parallel.apply keeps the stage's share)
    gathered = units * w.layer_compute_bytes + w.root_compute_bytes
    if s.offload == "full" and x.fsdp:
        # FSDP1 CPUOffload: each unit's CPU shard is first copied to the GPU (flat_param_to, a new tensor)
        # on the pre-unshard stream, then all-gathered (pytorch/pytorch@fe03cf693c7c774a88c01cd0bc52f80402b8437f
        # torch/distributed/fsdp/_flat_param.py pre_unshard / _all_gather_flat_param; @3ade90a6aaa939cd6238e314c321b9f920db1471
        # _runtime_utils.py _unshard). The caching allocator serves a stream only from its own blocks
        # (@eb42ad6eca0ce61e7c581212b4bf32f991425571 c10/cuda/CUDACachingAllocator.cpp get_free_block), so that
        # stream's pool holds the larger of the root's shard (copied first, at the root's pre-forward) and the blocks'.
        gathered += max(units * w.layer_compute_bytes, w.root_compute_bytes) // x.shard
    reduce_elem = 4 if s.precision in ("bf16-mixed", "fp32") else 2
    if s.fsdp_version == 1 and s.precision != "fp32" and not fp32_autocast:
        reduce_elem = 2  # FSDP1 MixedPrecision as accelerate builds it: reduce_dtype bf16
    grad_elem = 4 if fp32_autocast else x.a  # the unsharded gradient is in the gathered dtype
    if s.fsdp_version == 1:
        rs_buffers = _fsdp1_grad_buffers(w.layer_trainable, grad_elem, reduce_elem, x.shard)
    else:
        rs_buffers = w.layer_trainable * (grad_elem + reduce_elem) + w.layer_trainable * reduce_elem // x.shard
    if s.fsdp_version == 1 and x.fsdp and not fp32_autocast and s.precision == "bf16-mixed":
        # FSDP1 MixedPrecision first casts each unit's fp32 shard to a bf16 `_mp_shard`, then all-gathers
        # it into the padded flat parameter (torch/distributed/fsdp/_flat_param.py _use_low_precision_shard)
        gathered += units * w.layer_compute_bytes // x.shard
    return gathered, rs_buffers


def _fsdp1_grad_buffers(unit: int, grad_elem: int, reduce_elem: int, shard: int) -> int:
    """FSDP1's unsharded gradients while a unit runs backward (torch/distributed/fsdp, torch 2.13).

    The unit's parameters are autograd views split from the flat parameter (_flat_param.py
    _use_unsharded_views), so its gradient builds up view by view and SplitWithSizesBackward then cats
    them into one flat gradient beside them; the post-backward hook casts it to the reduce dtype if that
    differs and reduce-scatters it on the post-backward stream (_runtime_utils.py _post_backward_hook,
    _reduce_grad): the view gradients and their cat together, plus the reduce-dtype copy and the sharded
    output. (_no_dispatch_record_stream keeps the block until the reduce-scatter ends; whether that outlasts
    the next unit's backward depends on link and compute speed, so it is not counted.)"""
    cast = reduce_elem if reduce_elem != grad_elem else 0
    return unit * (2 * grad_elem + cast) + unit * reduce_elem // shard


def _autocast_cache(x: _Ctx) -> int:
    s = x.s
    if s.precision == "bf16-mixed" and s.task == "full" and s.sharding in ("none", "ddp") and s.offload != "full":
        return 2 * x.arch.params  # bf16 weight casts kept by autograd until each backward
    if autocast_fp32(s):
        return _autocast_weight_casts(x.arch, s)
    return 0


def _autocast_region_cache(x: _Ctx) -> int:
    """autocast's own cast cache under FSDP2 with fp32 compute parameters, alive until the region exits.

    torch.autocast caches the bf16 cast of an fp32 tensor only when it is a leaf that requires grad and not
    a view, and keeps it until the outermost autocast region exits
    (pytorch/pytorch@008ec6b1840c94ff6d0f685bc10fbf585167c673 aten/src/ATen/autocast_mode.cpp
    cached_cast, clear_cache). FSDP2 registers each unsharded parameter on its
    module as an nn.Parameter of its own, a leaf (pytorch/pytorch@cf30153c4c131c8164ee7798e5022d810682e2cb
    torch/distributed/fsdp/_fully_shard/_fsdp_param.py init_unsharded_param, to_unsharded), so the cast of every
    trainable weight stays cached after FSDP2 frees the gathered block: by the end of forward the cache holds
    a bf16 copy of every trainable weight a matmul read, on every GPU whatever the shard count. FSDP1 hands
    modules views of its flat parameter made under enable_grad (same commit, torch/distributed/fsdp/_flat_param.py
    _use_unsharded_views), never leaves, so nothing is cached there. Without recompute autograd saves the same
    casts until backward (_autocast_weight_casts), so the cache adds only where a checkpointed block saved none.
    Measured on CPU/gloo: benchmarks/autocast_cache_probe.py."""
    s, arch = x.s, x.arch
    if not (autocast_fp32(s) and x.fsdp and s.fsdp_version == 2 and s.activation_checkpointing != "none"):
        return 0
    if s.task != "full":
        return 2 * x.w.trainable  # only the adapters require grad; the frozen base's casts are never cached
    return 2 * arch.num_layers * arch.layer_linear_params() + 2 * (arch.lm_head_params or arch.embedding_params)


@dataclass(frozen=True)
class _Grads:
    """Bytes of gradients per GPU at the moments of a step they differ."""
    comm_buckets: int  # DDP / ZeRO flat buckets
    during_forward: int  # gradients alive through forward and backward
    head: int  # the output head's gradient, first to appear in backward


def _grads(x: _Ctx) -> _Grads:
    s, w = x.s, x.w
    comm_buckets = 0
    if s.sharding == "ddp":
        comm_buckets = w.grads  # DDP flat buckets duplicate the gradients
    elif s.sharding in ("zero1", "zero2"):
        bucket = constants()["zero_buckets"]["elements"] * x.a
        comm_buckets = min(2 * bucket, 2 * x.a * w.trainable)
    # FSDP's sharded grads sit in the reduce-scatter stream's cached blocks; DDP/ZeRO keep them;
    # with gradient accumulation every setup keeps them between micro-batches.
    during = w.grads if (s.sharding != "none" or int(s.grad_accumulation_steps or 1) > 1) else 0
    head = 0
    head_elem = 4 if autocast_fp32(s) else x.a
    if s.task == "full" and during == 0:
        head = head_elem * w.head_params  # the output head's gradient appears first in backward
    elif s.task == "full" and x.fsdp:
        head = head_elem * w.head_params  # unsharded grad of the root until its reduce-scatter
    return _Grads(comm_buckets=comm_buckets, during_forward=during, head=head)


def _step_transient(s: TrainSetup, w: Weights) -> int:
    impl = getattr(s, "optimizer_impl", "fused")
    if impl not in ("fused", "foreach"):
        raise GpuprovError(f"optimizer implementation {impl!r} is not one of fused, foreach")
    if impl == "foreach" and s.optimizer == "adamw" and s.offload == "none":
        # torch._foreach_sqrt(exp_avg_sqs) materialises one state-sized list before addcdiv_
        return w.optimizer // 2
    return 0  # fused AdamW: no per-step temporaries


# ---------------------------------------------------------------------------- the three moments


def _phases(x: _Ctx) -> list[_Phase]:
    """Start of backward, backward of the top block, optimizer step: the candidates for the peak."""
    w = x.w
    acts = act.activations(x.arch, x.s, x.tokens, x.a)
    docs = act.document_masks(x.arch, x.s, x.a)
    lossb = act.loss(x.arch, x.s, x.tokens, x.a)
    gathered, rs_buffers = _gathered(x)
    cache = _autocast_cache(x)
    g = _grads(x)
    step_transient = _step_transient(x.s, w)
    stranded = _stranded_at_loss(x, acts)
    buffers = act.hf_buffer_bytes(x.arch, x.s)  # resident on every GPU, whatever FSDP shards or offloads
    base = {"parameters": w.params + buffers, "optimizer_states": w.optimizer, "fp32_master": w.master,
            "comm_buckets": g.comm_buckets}
    in_flight = {"gathered_params": gathered, "autocast_weight_cache": cache, "reduce_scatter_buffers": rs_buffers}
    phases = [
        _Phase("start of backward (loss)", {
            **base, "gradients": g.during_forward, **in_flight, "activations": acts.saved,
            "logits": lossb.at_backward, "cross_entropy": lossb.cross_entropy,
            "document_mask": docs.mask, "attention_bias": docs.bias_saved, "allocator_fragmentation": stranded,
        }),
        _Phase("backward of the last block", {
            **base, "gradients": g.during_forward + g.head, **in_flight,
            "activations": acts.saved - x.tokens * acts.final_norm,
            "activation_transient": acts.layer_transient, "logits": lossb.held,
            "document_mask": docs.mask, "attention_bias": docs.bias_saved + docs.bias_transient,
        }),
        _Phase("optimizer step", {
            **base, "gradients": w.grads, "gathered_params": gathered if x.fsdp else 0,
            "optimizer_step_transient": step_transient, "logits": lossb.held,
        }),
    ]
    region = _autocast_region_cache(x)
    if region:
        # the model's forward returns inside the autocast region (the loss runs after it exits): every saved
        # activation and the logits beside the whole cache, before any loss buffer exists
        phases.append(_Phase("end of forward (autocast cast cache)", {
            **base, "gradients": g.during_forward, "gathered_params": gathered,
            "autocast_weight_cache": max(cache, region), "activations": acts.saved, "logits": lossb.at_backward,
        }))
    return phases


def _stranded_at_loss(x: _Ctx, acts: act.Activations) -> int:
    """Cached blocks the loss cannot use when a full-AC forward reaches an fp32 loss (idle_cache.py).

    The CUDA caching allocator serves a request only from a free block at least as large on the same stream
    (best fit), splits blocks but merges only the pieces of one segment, and gives cached segments back only
    when cudaMalloc fails (pytorch/pytorch@eb42ad6eca0ce61e7c581212b4bf32f991425571
    c10/cuda/CUDACachingAllocator.cpp get_free_block, try_merge_blocks, release_cached_blocks). The fp32
    logit-sized buffers of the loss are larger than any block a forward leaves cached, so at the start of
    backward that cache is reserved and idle. Where the run's stack is one idle_cache.py traces, its allocation
    order is replayed; elsewhere the working-set floor stands in."""
    s, arch = x.s, x.arch
    if s.activation_checkpointing != "full" or arch.is_moe or s.chunked_cross_entropy:
        return 0
    if x.a != 2 or not s.loss_upcast:
        return 0
    if s.compile:
        return idle_cache.compiled_stranded_at_loss(arch, s, x.tokens, x.a, 1, arch.num_layers)
    if not autocast_fp32(s) and not kbit_fp32(s):
        traced = idle_cache.hf_eager_stranded_at_loss(arch, s)
        if traced is not None:
            return traced
    return working_set_floor(arch, s, x.tokens, x.a, acts.final_norm)


def working_set_floor(arch: ModelArch, s: TrainSetup, tokens: int, a: int, final_norm: int) -> int:
    """The least an eager full-AC forward leaves idle at the loss. Each block's forward allocates and frees the
    same working set: the MLP's intermediates (SiLU output, up_proj output and, with a LoRA adapter on up_proj,
    its base output, lora_B output and scaled copy: transformers v4.38.2 LlamaMLP.forward, peft 0.10.0
    tuners/lora/layer.py Linear.forward and bnb.py Linear4bit.forward) beside the residual and the normalised
    input. Only the final norm reuses those blocks, and the compute-dtype logits a model frees when it upcasts
    its own output (transformers < 4.45 `logits = logits.float()`) fit none of them."""
    adapted = resolve_lora_targets(s.lora_targets) if s.task != "full" else ()
    mlp = (4 if "up_proj" in adapted else 3) * arch.intermediate_size
    working_set = a * (2 * arch.hidden_size + mlp) - final_norm
    upcast = 0
    if (s.loss_impl == "hf-legacy" or s.fp32_logits) and not autocast_fp32(s) and not kbit_fp32(s):
        upcast = a * arch.vocab_size  # the bf16 logits freed by the model's .float()
    return tokens * (max(working_set, 0) + upcast)


def _reserved(phase: _Phase, s: TrainSetup) -> int:
    """A phase's live tensors plus the allocator's idle cache (what decides which moment peaks)."""
    return phase.total() - phase.terms.get("allocator_fragmentation", 0) + _fragmentation(phase.terms, s)


def _fragmentation(terms: dict[str, int], s: TrainSetup) -> int:
    """Cached-but-unusable blocks: freed tensors whose blocks belong to another stream or do not fit the next
    request (eager mode frees many odd-sized intermediates; compile fuses them away). Where a phase knows the
    blocks it strands (_stranded_at_loss), those are the floor: both are the same idle cache."""
    alloc = constants()["allocator"]
    frac = alloc["fragmentation_compiled"] if s.compile else alloc["fragmentation_eager"]
    live = sum(v for k, v in terms.items() if k != "allocator_fragmentation")
    return int(max(int(live * frac), int(terms.get("allocator_fragmentation", 0))))


def _outside_terms(terms: dict[str, int], s: TrainSetup) -> dict[str, int]:
    """Allocator fragmentation, NCCL buffers and the CUDA context on top of the live tensors."""
    c = constants()
    out = dict(terms)
    out.pop("allocator_fragmentation", 0)
    out["allocator_fragmentation"] = _fragmentation(terms, s)
    nc = c["nccl"]
    if s.gpus > 1:
        out["nccl_buffers"] = int(nc["buffsize_bytes"] * nc["channels"] * nc["connections_per_channel"] * nc["protocol_factor"])
        out["nccl_buffers"] *= parallel.communicators(s)
    out["cuda_context"] = int(c["cuda_context"]["bytes"])
    return {k: int(v) for k, v in out.items()}


def estimate_memory(arch: ModelArch, setup: TrainSetup, gpu_memory_bytes: int | None = None) -> MemoryEstimate:
    """Predicted peak bytes on the busiest GPU, with every term and the assumptions behind it."""
    validate_setup(arch, setup)
    parallel.validate(arch, setup)
    s = setup
    fsdp = s.sharding in ("fsdp", "hsdp")
    shard = parallel.fsdp_degree(s, shard_group_size(s) if s.sharding == "hsdp" else s.gpus)
    a = 4 if s.precision == "fp32" else 2
    tokens = s.seq_len * s.micro_batch
    w = model_states(arch, s, shard)
    x = _Ctx(arch=arch, s=s, w=w, shard=shard, a=a, tokens=tokens)
    peak = max(parallel.apply(arch, s, _phases(x), tokens, a), key=lambda p: _reserved(p, s))
    terms = {t: 0 for t in TERMS}
    terms.update(peak.terms)
    terms = _outside_terms(terms, s)
    per_gpu = sum(terms.values())

    grad_accum = int(s.grad_accumulation_steps or 1)
    notes = memory_notes.assumptions(arch, s, peak.name, fsdp, shard, grad_accum, bool(s.activation_offloading))
    notes.extend(memory_notes.stack_assumptions(arch, s, fsdp))
    if gpu_memory_bytes is not None:
        free = gpu_memory_bytes - per_gpu
        verdict = "fits" if free >= 0 else "does not fit"
        notes.append(f"{verdict} in {gpu_memory_bytes / GIB:.1f} GiB with {free / GIB:+.1f} GiB to spare")
    states = (w.params + w.grads + w.optimizer + w.master) * s.gpus // parallel.layout(s).model_shards
    return MemoryEstimate(
        per_gpu_bytes=per_gpu,
        breakdown=terms,
        model_states_bytes=int(states),
        trainable_params=w.trainable,
        assumptions=tuple(notes),
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
