"""The assumptions behind one memory estimate, one line each (gpuprov.sizing.memory)."""

from __future__ import annotations

from gpuprov.sizing import idle_cache, parallel
from gpuprov.sizing.activations import LOSS_IMPLS
from gpuprov.sizing.arch import ModelArch
from gpuprov.sizing.memory_weights import (
    autocast_fp32,
    constants,
    float8_gather,
    frozen_flat_grads,
    kbit_fp32,
    loss_compiled,
    unsharded_accumulation,
)
from gpuprov.sizing.types import TrainSetup


def assumptions(
    arch: ModelArch, s: TrainSetup, peak: str, fsdp: bool, shard: int, grad_accum: int, act_offload: bool
) -> list[str]:
    out = [f"peak at the {peak}", _states_note(s, fsdp)]
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
        out.append("FSDP CPU offload: each unit's shard is copied to the GPU on the pre-unshard stream, then all-gathered"
                   " (current + prefetched unit, plus the root kept from forward to backward); that stream's cached blocks"
                   " hold the larger of the root's shard and two blocks' shards")
    attn = "SDPA/FlashAttention (no s^2 scores stored), GQA K/V repeated to the query heads"
    if arch.model_type == "gemma2":
        attn += "; gemma2 attention soft-capping needs flash-attn >= 2.6 for this (eager attention would store s^2 scores)"
    out.append(attn)
    out.extend(family_notes(arch, s.task))
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
        chunks = constants()["cross_entropy"]["chunks"]
        fused = loss_compiled(s)
        out.append(f"chunked cross-entropy ({chunks} chunks, fp32 upcast per chunk), loss "
                   + ("compiled (one chunk's fused gradient at a time)" if fused
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
    out.extend(_allocator_notes(arch, s))
    out.append("weights loaded sharded (meta-device init + sharded load); loaders that first put the whole model on every GPU need more at start-up")
    out.extend(parallel.assumptions(arch, s))
    return out


def _allocator_notes(arch: ModelArch, s: TrainSetup) -> list[str]:
    """What the caching allocator holds beyond the live tensors: its fragmentation and the idle cache at the loss."""
    out = []
    frag = constants()["allocator"]["fragmentation_compiled" if s.compile else "fragmentation_eager"]
    out.append(
        f"PyTorch caching allocator: +{frag:.0%} over live tensors for fragmentation (reserved vs allocated);"
        " CUDA context and NCCL buffers outside it; near a full GPU the allocator frees its cache and retries,"
        " so torch.cuda.max_memory_reserved() reads at most the GPU's memory less context and NCCL"
    )
    traced = (not autocast_fp32(s) and not kbit_fp32(s) and s.loss_upcast
              and idle_cache.hf_eager_stranded_at_loss(arch, s) is not None)
    if traced:
        out.append("at the start of backward the allocator's idle cache is what the eager forward left cached"
                   " (transformers 4.38 Llama blocks, peft LoRA, the legacy loss, op by op, replayed through the"
                   " caching allocator's rules) that the loss's larger logit-sized buffers cannot reuse")
    elif s.activation_checkpointing == "full" and not s.compile and not s.chunked_cross_entropy and not arch.is_moe:
        out.append("at the start of backward the allocator's idle cache is at least what the loss cannot reuse: one"
                   " block's forward working set (MLP intermediates, residual, normalised input) and, where the model"
                   " upcasts its own output, the freed compute-dtype logits (a free block serves only smaller requests;"
                   " segments never merge)")
    if (s.activation_checkpointing == "full" and s.compile and s.compile_scope == "block" and not s.chunked_cross_entropy
            and not arch.is_moe and s.loss_upcast):
        out.append("at the start of backward the allocator's idle cache is what the compiled blocks' forwards left cached"
                   " (norm outputs, float8 casts, TP all-gathers and partial outputs, matmul and attention outputs,"
                   " replayed through the caching allocator's rules) that the loss's larger logit-sized buffers cannot"
                   " reuse, plus the compute-dtype logits freed before backward")
    return out


def stack_assumptions(arch: ModelArch, s: TrainSetup, fsdp: bool) -> list[str]:
    """What the stack knobs (framework presets) changed, one line each where they apply."""
    out = []
    if fsdp:
        out.append(
            "FSDP1 (FullyShardedDataParallel, flat parameters; the root unit holds embeddings + head)" if s.fsdp_version == 1
            else "FSDP2 (fully_shard, per-parameter DTensor shards)"
        )
    if s.task == "qlora" and s.kbit_fp32_casts:
        out.append(
            "QLoRA prepared by peft's prepare_model_for_kbit_training: embeddings, norms and head held in fp32"
            " (fp32 gathers of them under FSDP); fp32 residual stream; bitsandbytes Linear4bit returns its outputs"
            " in that dtype, so the MLP's gate/up/SiLU tensors are saved fp32; adapters fp32"
            + ("; fp32 head, so fp32 logits (no autocast)" if s.precision != "bf16-mixed" else "")
        )
    if s.hf_llama_438 and arch.model_type in ("llama", "gemma"):
        out.append("transformers 4.38 Llama code: a dense (batch, 1, max positions, max positions) causal mask in the"
                   " compute dtype kept from forward to backward (SDPA takes it as attn_mask), and each layer's rotary"
                   " cos/sin cache buffers (fp32) on every GPU")
    if getattr(s, "document_mask", False):
        cp = max(1, s.cp)
        out.append(
            f"per-document attention on packed samples: one boolean {s.micro_batch} x {s.seq_len // cp} x {s.seq_len}"
            " mask per micro-batch from forward to backward, and SDPA's additive copy of it in the compute dtype ("
            + ("every block keeps its own until its backward" if s.activation_checkpointing == "none" and not s.compile
               else "the block running backward") + "); the memory-efficient kernel, not FlashAttention, runs it"
        )
    if autocast_fp32(s):
        out.append(
            "torch.autocast over fp32 parameters (no FSDP mixed-precision policy): fp32 weights"
            + (" and fp32 all-gathers" if fsdp else "") + "; fp32 residual stream, norms and embeddings;"
            " each linear saves its own bf16 casts of input and weight"
        )
        if fsdp and s.fsdp_version == 2 and s.activation_checkpointing != "none":
            out.append("FSDP2 leaves unsharded parameters as leaves, so autocast caches the bf16 cast of every"
                       " trainable weight until its region exits: an unsharded bf16 copy of them at the end of forward")
        elif fsdp and s.fsdp_version == 1:
            out.append("FSDP1 gives modules views of its flat parameter, so autocast's cast cache holds none of them")
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


def _states_note(s: TrainSetup, fsdp: bool) -> str:
    """Which model states the run keeps, and in which dtype."""
    if s.task != "full":
        base = "NF4 (blocksize 64, double-quantized absmax) decoder linears, bf16 embeddings/head" if s.task == "qlora" else "bf16 frozen base"
        if s.task == "qlora" and getattr(s, "qlora_base_replicated", False):
            base += ", replicated on every GPU"
        elif s.sharding in ("fsdp", "hsdp"):
            base += ", sharded by FSDP"
        return f"{s.task}: {base}; only adapters (rank {s.lora_rank}) have gradients and optimizer state"
    if fsdp:
        return {
            "bf16-mixed": "FSDP2 bf16-mixed: fp32 sharded params + fp32 sharded grads + 2 fp32 AdamW states, bf16 all-gathered blocks, fp32 reduce-scatter",
            "bf16": "FSDP2 pure bf16: params, grads and AdamW states all bf16, sharded",
            "fp32": "FSDP2 fp32: params, grads and AdamW states fp32, sharded",
        }[s.precision]
    if s.sharding in ("zero1", "zero2") and s.precision == "bf16-mixed":
        return "ZeRO (DeepSpeed bf16): bf16 params and grads, fp32 master + fp32 grad partition + AdamW states partitioned"
    if s.precision == "bf16-mixed":
        return "torch.autocast bf16: fp32 params, fp32 grads, fp32 AdamW states, and bf16 weight casts kept for backward (18 B/param)"
    return f"{s.precision}: params, grads and AdamW states in {s.precision.replace('-mixed', '')}"


def family_notes(arch: ModelArch, task: str = "full") -> list[str]:
    """What the model's family changes in the sizing: experts, latent attention, windows, what is left out."""
    out = []
    if arch.is_moe:
        shared = f" + a shared expert of width {arch.shared_intermediate_size}" if arch.shared_intermediate_size else ""
        dense = f"; {arch.dense_layers} of {arch.num_layers} blocks dense" if arch.dense_layers else ""
        # under LoRA the experts are frozen base weights: no gradients, no optimizer states
        held = "weights, gradients and optimizer states are" if task == "full" else f"frozen weights are ({task}: no gradients or optimizer states)"
        out.append(f"MoE: all {arch.num_experts} experts' {held} held, sharded by "
                   "FSDP with the rest of each block and gathered whole per block (no expert parallelism); activations "
                   f"and FLOPs from the {arch.experts_per_token} routed experts per token{shared}{dense}")
    if arch.mla:
        qr, kvr, rope, nope, v = arch.mla
        out.append(f"multi-head latent attention: latents of {qr} (q) and {kvr} + {rope} (kv) saved, K/V decompressed "
                   f"to {arch.num_attention_heads} heads of {nope + rope} (q/k) and {v} (v) for attention")
    if arch.sliding_layers:
        out.append(f"sliding-window attention on {arch.sliding_layers} of {arch.num_layers} blocks (window "
                   f"{arch.sliding_window}): a (micro-batch, seq, seq) bool mask once seq exceeds it; FLOPs counted "
                   "as full causal attention (SDPA computes the masked blocks)")
    if arch.excluded:
        out.append(f"not sized: {arch.excluded}")
    return out
