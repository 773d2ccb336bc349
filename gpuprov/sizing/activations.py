"""Activations and the loss: the bytes each token leaves saved for backward, per decoder block.

Counted from the tensors autograd saves in a Llama-style block (RMSNorm, RoPE, SDPA/FlashAttention,
GQA, SwiGLU), the approach of Korthikanti et al. 2022 without the s^2 attention term (FlashAttention
never stores the score matrix); then the logits and the cross-entropy buffers of the loss stack.
Part of the analytic estimate (gpuprov.sizing.memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuprov.errors import GpuprovError
from gpuprov.sizing.arch import ModelArch, resolve_lora_targets
from gpuprov.sizing.families import family
from gpuprov.sizing.memory_weights import autocast_fp32, constants, kbit_fp32, loss_compiled
from gpuprov.sizing.types import TrainSetup

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


def _kv_as_attended(arch: ModelArch) -> int:
    """K/V width fed to SDPA: GQA heads are repeated (repeat_kv copies) to the query heads."""
    return arch.q_dim if arch.num_kv_heads < arch.num_attention_heads else arch.kv_dim


def _norms_per_layer(arch: ModelArch) -> int:
    return family(arch.model_type).norms


def _norm_bytes(width: int, a: int, compiled: bool) -> int:
    """What one RMSNorm over `width` saves per token."""
    return 2 * a * width if compiled else 4 * width + 2 * a * width  # eager: fp32 upcast copy too


def _qk_norm_width(arch: ModelArch) -> int:
    """Width the q/k (or MLA latent) norms run over per token: Qwen3/Gemma 3 per head over every head,
    OLMo 2 over the whole projections, DeepSeek's q_a/kv_a latent norms."""
    if arch.mla:
        return arch.mla[0] + arch.mla[1]
    return arch.q_dim + arch.kv_dim if family(arch.model_type).qk_norm else 0


def _attention_elems(arch: ModelArch) -> int:
    """Elements per token attention saves, beyond its norms: q_rot, k, v, out, o_proj input (GQA K/V as
    attended). MLA (transformers' DeepseekV3Attention) also keeps its latents: q_b's input (q_lora_rank),
    kv_a's output (kv_lora_rank + rope), kv_b's input and output (heads x (nope + v)); V is v_head_dim wide."""
    if not arch.mla:
        q, kv = arch.q_dim, _kv_as_attended(arch)
        return q + 2 * kv + q + q
    qr, kvr, rope, nope, v = arch.mla
    heads = arch.num_attention_heads
    latents = qr + (kvr + rope) + kvr + heads * (nope + v)
    return latents + arch.q_dim + arch.kv_dim + arch.v_dim + 2 * arch.attn_out_dim


def _mlp_bytes(arch: ModelArch, a: int, compiled: bool, dense: bool) -> int:
    h = arch.hidden_size
    per_width = (3 if compiled else 4) * a  # gate, up, (silu), product
    if not arch.is_moe or dense:
        return per_width * (arch.dense_intermediate_size if (arch.is_moe and arch.dense_intermediate_size)
                            else arch.intermediate_size)
    k = arch.experts_per_token
    routed = k * (per_width * arch.intermediate_size + 2 * a * h) + 4 * arch.num_experts * 2  # copies + router probs
    return routed + per_width * arch.shared_intermediate_size  # DeepSeek's shared expert runs on every token


def layer_activation_bytes_per_token(arch: ModelArch, a: int, compiled: bool, lora_rank_sum: int = 0,
                                     dense: bool = False) -> int:
    """Bytes one token leaves saved for backward in one decoder block, no checkpointing (`dense`: an
    MoE model's dense block)."""
    h = arch.hidden_size
    norms = _norms_per_layer(arch) * _norm_bytes(h, a, compiled) + _norm_bytes(_qk_norm_width(arch), a, compiled)
    attn = a * _attention_elems(arch) + 4 * arch.num_attention_heads  # + the softmax lse
    lora = a * lora_rank_sum  # adapters' A outputs
    return norms + attn + _mlp_bytes(arch, a, compiled, dense) + lora


def mean_layer_activation_bytes_per_token(arch: ModelArch, a: int, compiled: bool, lora_rank_sum: int = 0) -> int:
    """Per block, averaged over an MoE model's dense and expert blocks (DeepSeek's first dense blocks)."""
    moe = layer_activation_bytes_per_token(arch, a, compiled, lora_rank_sum)
    if not arch.is_moe or not arch.dense_layers:
        return moe
    dense = layer_activation_bytes_per_token(arch, a, compiled, lora_rank_sum, dense=True)
    return (moe * arch.moe_layers + dense * arch.dense_layers) // arch.num_layers


def lora_dropout_bytes_per_token(arch: ModelArch, a: int, targets: tuple[str, ...]) -> int:
    """PEFT/torchtune LoRA with dropout > 0: every adapted module drops out its own copy of its input
    (nn.Dropout per module) and autograd keeps that copy (input of lora_A) and the bool mask."""
    shapes = arch.linear_shapes()
    k = arch.experts_per_token if arch.is_moe else 1
    width = sum(shapes[t][0] * (k if shapes[t][2] > 1 else 1) for t in targets)
    return (a + constants()["lora_dropout"]["mask_bytes"]) * width


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
        mlp = a * (arch.intermediate_size * arch.experts_per_token + arch.shared_intermediate_size)
        return a * (h + q + arch.kv_dim + arch.attn_out_dim + h) + mlp + 4 * arch.num_attention_heads
    count = saved = 0
    for name, (_, out_features, _) in arch.linear_shapes().items():  # forward order
        outputs = [] if _biased(arch, name) else [out_features]
        if name in lora_targets:
            outputs += [lora_rank, out_features]  # lora_A, lora_B (no bias)
        for width in outputs:
            count += 1
            saved += width if count % 2 == 1 else 0
    return a * (h + arch.attn_out_dim + saved) + 4 * arch.num_attention_heads  # block input, SDPA out (+ lse)


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


def kbit_extra_bytes_per_token(arch: ModelArch, autocast: bool) -> int:
    """Extra bytes per token and block of a QLoRA model whose residual stream is fp32 (peft's casts).

    bitsandbytes Linear4bit.forward casts its input to the compute dtype and returns `out.to(inp_dtype)`
    (bitsandbytes 0.45.0 bitsandbytes/nn/modules.py Linear4bit.forward), so with fp32
    inputs gate_proj and up_proj hand fp32 outputs to SiLU and the product, which save them (and SiLU's
    output) in fp32: 2 B x intermediate more for each of the three than a bf16 block. Under autocast SDPA
    casts q, k, v to bf16 and saves those; without it attention runs (and saves q, k, v and its output) fp32."""
    extra = 2 * 3 * arch.intermediate_size
    if not autocast:
        extra += 2 * (arch.q_dim + 2 * _kv_as_attended(arch) + arch.q_dim)
    return extra


def dense_causal_mask_bytes(arch: ModelArch, s: TrainSetup, elem: int) -> tuple[int, int]:
    """(the dense causal mask kept from forward to backward, its per-block slice) of transformers 4.38.

    transformers v4.38.2 models/llama/modeling_llama.py: LlamaModel registers a (max_positions, max_positions)
    bool `causal_mask` buffer and `_update_causal_mask` turns it into
    `self.causal_mask[None, None, :, :].repeat(batch_size, 1, 1, 1).to(dtype) * min_dtype` every forward (the
    embeddings' dtype; a buffer doubled once when the sequence is longer). Every decoder block receives it, so the
    checkpointed blocks keep it as an input until the first block's backward; LlamaSdpaAttention indexes
    `causal_mask[:, :, cache_position, :kv_len]` (a copy, batch x seq^2) and hands it to SDPA as attn_mask, which
    keeps it for backward in the block being recomputed. 4.39 dropped the dense mask for SDPA's is_causal
    (huggingface/transformers PR 29753); Mistral in 4.38 still used _prepare_4d_causal_attention_mask_for_sdpa
    (None without padding)."""
    if not s.hf_llama_438 or arch.model_type not in ("llama", "gemma") or not arch.max_position_embeddings:
        return 0, 0
    positions = arch.max_position_embeddings
    if s.seq_len > positions:
        positions *= 2
    return s.micro_batch * positions * positions * elem, s.micro_batch * s.seq_len * s.seq_len * elem


@dataclass(frozen=True)
class DocumentMasks:
    """Bytes of the attention masks that keep packed documents apart."""
    mask: int  # the boolean mask(s), held from the model's forward to the end of its backward
    bias_saved: int  # SDPA's additive bias copies autograd keeps until each block's backward
    bias_transient: int  # the bias of the block running backward (recomputed under checkpointing)


def document_masks(arch: ModelArch, s: TrainSetup, a: int) -> DocumentMasks:
    """Per-document attention's masks for one micro-batch (s.document_mask: gpuprov's trainer on packed data).

    gpuprov templates/launch/train_attention.py model_inputs builds one boolean [b, 1, q, s] mask per micro-batch
    (q = s / cp: under CP this rank's queries against the whole window) and hands it to the model, which gives
    that one tensor to every layer (transformers uses a 4-D mask as given); the checkpointed blocks keep it as an
    input until their backward, so it lives from forward to the end of backward: one copy, not one per layer.
    SDPA turns a boolean mask into an additive one of the query dtype in every call
    (pytorch/pytorch@bc8cb28010a6b27e1817d38e1c1e0ac59b34477e aten/src/ATen/native/transformers/attention.cpp
    convert_boolean_attn_mask: zeros_like(mask, dtype).masked_fill_; the memory-efficient kernel only expands it,
    a view, and pads it only when the last dim is not a multiple of 16), and the memory-efficient backward takes
    that bias (tools/autograd/derivatives.yaml _scaled_dot_product_efficient_attention; in torch 2.13
    `torch._C._functions.ScaledDotProductEfficientAttentionBackward0` has `_saved_attn_bias`). Without
    checkpointing every eager block keeps its own; under checkpointing (full, or op-level SAC, whose policy saves
    the attention output, not its bias) only the block being recomputed holds one. Compiled blocks without
    checkpointing are counted as recomputing the bias from the boolean mask in backward (a cheap pointwise op the
    partitioner prefers to recompute rather than save); that is an assumption, not a measurement."""
    if not getattr(s, "document_mask", False):
        return DocumentMasks(0, 0, 0)
    cp = max(1, int(getattr(s, "cp", 1) or 1))
    scores = s.micro_batch * (s.seq_len // cp) * s.seq_len
    bias = scores * a
    if s.activation_checkpointing == "none" and not s.compile:
        return DocumentMasks(mask=scores, bias_saved=arch.num_layers * bias, bias_transient=0)
    return DocumentMasks(mask=scores, bias_saved=0, bias_transient=bias)


def hf_buffer_bytes(arch: ModelArch, s: TrainSetup) -> int:
    """GPU buffers of transformers 4.38's Llama model, which FSDP neither shards nor offloads (only parameters).

    transformers v4.38.2 models/llama/modeling_llama.py: every LlamaAttention builds its own LlamaRotaryEmbedding,
    which registers `_cos_cached` and `_sin_cached` (max_positions x head_dim, "for BC") in torch's default dtype
    (fp32 unless the model is built under a torch_dtype; fp32 is assumed), and LlamaModel the bool
    (max_positions x max_positions) `causal_mask`."""
    if not s.hf_llama_438 or arch.model_type not in ("llama", "gemma") or not arch.max_position_embeddings:
        return 0
    positions = arch.max_position_embeddings
    head_dim = arch.q_dim // arch.num_attention_heads
    return arch.num_layers * 2 * positions * head_dim * 4 + positions * positions


def sliding_mask_bytes(arch: ModelArch, s: TrainSetup) -> int:
    """The boolean (batch, 1, seq, seq) sliding-window mask SDPA gets (and saves for backward) once the
    sequence is longer than the window: transformers masking_utils' sliding_window_causal_mask, built once
    per forward and shared by every local block (Gemma 3's five of six, Mistral's and Phi-3's all); shorter
    sequences attend causally (no mask). SDPA runs such a mask on its memory-efficient kernel, which still
    stores no s^2 scores, and computes every block of the product: the FLOPs stay those of full causal
    attention (sizing/throughput.py)."""
    if not arch.sliding_layers or not arch.sliding_window or s.seq_len <= arch.sliding_window:
        return 0
    return s.micro_batch * s.seq_len * s.seq_len


def _grad_work_bytes_per_token(arch: ModelArch, a: int) -> int:
    """Activation gradients alive while one block runs backward (MLP-wide plus residual)."""
    k = arch.experts_per_token if arch.is_moe else 1
    width = max(arch.intermediate_size * k + arch.shared_intermediate_size, arch.dense_intermediate_size)
    return a * (2 * width + 2 * arch.hidden_size)


# ---------------------------------------------------------------------------- one micro-batch


@dataclass(frozen=True)
class Activations:
    """Bytes of activations per GPU: saved for backward, and transient in one block."""
    saved: int  # every block's saved tensors plus the final norm's, at the start of backward
    final_norm: int  # per token: what the final RMSNorm saves (freed first in backward)
    layer_transient: int  # the block running backward: recomputation, activation gradients, casts


def _per_layer(arch: ModelArch, s: TrainSetup, a: int) -> tuple[int, int]:
    """(bytes per token one block saves under the run's checkpointing, bytes it recomputes in backward)."""
    adapted = resolve_lora_targets(s.lora_targets) if s.task != "full" else ()
    lora_rank_sum = s.lora_rank * len(adapted)
    full_layer = mean_layer_activation_bytes_per_token(arch, a, s.compile, lora_rank_sum)
    fp32_autocast = autocast_fp32(s) or kbit_fp32(s)
    if fp32_autocast:
        full_layer += autocast_extra_bytes_per_token(arch, adapted)
    if kbit_fp32(s):
        full_layer += kbit_extra_bytes_per_token(arch, autocast=s.precision == "bf16-mixed")
    resid = 4 if fp32_autocast else a  # the residual stream (a block's input) dtype
    if s.task != "full" and float(getattr(s, "lora_dropout", 0.0) or 0.0) > 0:
        full_layer += lora_dropout_bytes_per_token(arch, a, adapted)
    if s.activation_checkpointing == "none":
        return full_layer, 0
    if s.activation_checkpointing == "selective":
        saved = selective_layer_bytes_per_token(arch, a, adapted, s.lora_rank)
        saved += (resid - a) * arch.hidden_size
        return saved, max(full_layer - saved, 0)
    saved = resid * arch.hidden_size
    return saved, full_layer - saved


def activations(arch: ModelArch, s: TrainSetup, tokens: int, a: int) -> Activations:
    """Saved activations of one micro-batch of `tokens` tokens with `a`-byte compute elements."""
    saved_layer, recompute = _per_layer(arch, s, a)
    h = arch.hidden_size
    # the final RMSNorm runs eager unless the whole model is compiled
    final_norm = 2 * a * h if (s.compile and s.compile_scope == "model") else 4 * h + 2 * a * h
    if autocast_fp32(s) or kbit_fp32(s):
        final_norm += 2 * h
    if s.activation_offloading:
        # Offloaded activations stream to host; roughly two blocks stay resident (current + in flight).
        saved = tokens * (saved_layer * min(arch.num_layers, 2)) + tokens * final_norm
    else:
        saved = tokens * (saved_layer * arch.num_layers + final_norm)
    transient = tokens * (recompute + _grad_work_bytes_per_token(arch, a))
    mask, mask_slice = dense_causal_mask_bytes(arch, s, 4 if (autocast_fp32(s) or kbit_fp32(s)) else a)
    saved += mask + sliding_mask_bytes(arch, s)
    if s.activation_checkpointing != "none":
        transient += mask_slice  # the recomputed block's attn_mask copy (every block keeps its own without AC)
    else:
        saved += arch.num_layers * mask_slice
    if s.task == "qlora":
        transient += 2 * h * max(arch.intermediate_size, arch.q_dim)  # one linear dequantized to bf16 at a time
    if autocast_fp32(s) and s.activation_checkpointing != "none":
        transient += 2 * arch.layer_linear_params()  # the recomputed block's bf16 weight casts
    return Activations(saved=saved, final_norm=final_norm, layer_transient=transient)


@dataclass(frozen=True)
class Loss:
    """Bytes of the logits and cross-entropy buffers around the loss."""
    at_backward: int  # logits still referenced when backward starts
    held: int  # logits the loop keeps through backward and the optimizer step
    cross_entropy: int  # log-softmax (or fused-gradient) buffers at the start of backward


def _logits(arch: ModelArch, s: TrainSetup, tokens: int, a: int) -> int:
    legacy = s.loss_impl == "hf-legacy" and not s.chunked_cross_entropy
    # fp32 model output: transformers < 4.45, or torchtune's unembed `.float()` (its chunked output stays bf16)
    fp32_out = legacy or (s.fp32_logits and not s.chunked_cross_entropy)
    # peft's casts leave the output head fp32: without autocast its logits come out fp32
    fp32_out = fp32_out or (kbit_fp32(s) and s.precision != "bf16-mixed")
    elem = constants()["loss_impl"]["legacy_logits_bytes"] if fp32_out else a
    logits = tokens * elem * arch.vocab_size  # the model output, held by the caller at least until backward
    if arch.model_type == "gemma2":
        logits += tokens * a * arch.vocab_size  # final logit soft-capping saves the tanh output too
    return logits


def _cross_entropy(arch: ModelArch, s: TrainSetup, tokens: int, a: int) -> int:
    ce = constants()["cross_entropy"]
    V, chunks = arch.vocab_size, ce["chunks"]
    # log-softmax and its gradient in fp32, or in the logits' dtype; under autocast log_softmax runs in fp32
    amp = autocast_fp32(s) or (s.precision == "bf16-mixed" and s.sharding in ("none", "ddp"))
    elem = 4 if (s.loss_upcast or amp) else a
    if s.chunked_cross_entropy and loss_compiled(s):
        return tokens * elem * V // chunks  # fused per-chunk loss: one chunk's gradient at a time
    if s.chunked_cross_entropy:
        return tokens * elem * V + tokens * elem * V * 2 // chunks
    if int(getattr(s, "tp", 1) or 1) > 1 and elem == 4:
        # loss_parallel(): torch's vocab-sharded nll + log-softmax backward (the caller divides by tp)
        return tokens * elem * V * ce["fp32_buffers_loss_parallel"]
    if loss_compiled(s):
        # the loss is inside the compiled graph: inductor saves the logits and the logsumexp and writes
        # the logits' gradient in one fused kernel (softmax - one-hot), no log-softmax buffer
        return tokens * elem * V * ce["fp32_buffers_compiled"]
    return tokens * elem * V * ce["fp32_buffers_eager"]


def loss(arch: ModelArch, s: TrainSetup, tokens: int, a: int) -> Loss:
    impl = getattr(s, "loss_impl", "hf")
    if impl not in LOSS_IMPLS:
        raise GpuprovError(f"loss implementation {impl!r} is not one of {', '.join(LOSS_IMPLS)}")
    logits = _logits(arch, s, tokens, a)
    # HF loops keep `outputs` until after the optimizer step (litgpt its chunked logits through backward);
    # torchtitan and torchtune free them before backward. At the start of backward an eager loss has saved
    # only its fp32 log-softmax, so logits a loop deleted are gone; a fused (compiled) loss saves its input
    # logits and rebuilds the softmax in backward.
    native = impl == "native"
    return Loss(
        at_backward=logits if (not native or loss_compiled(s)) else 0,
        held=0 if native else logits,
        cross_entropy=_cross_entropy(arch, s, tokens, a),
    )
