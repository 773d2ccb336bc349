"""The memory model term by term: what FSDP2/AMP/ZeRO/LoRA/QLoRA hold, and bad input."""

from __future__ import annotations

import pytest

from gpuprov.catalog.models import get_model
from gpuprov.errors import GpuprovError
from gpuprov.sizing.memory import (
    NON_ALLOCATOR_TERMS,
    TERMS,
    ExtendedSetup,
    allocator_bytes,
    estimate_memory,
    nf4_bytes_per_param,
)
from gpuprov.sizing.types import TrainSetup

GIB = 2**30
L8B = get_model("llama-3.1-8b")
L7B = get_model("llama-2-7b")


def est(arch=L8B, **kw):
    return estimate_memory(arch, TrainSetup(**kw))


def test_breakdown_sums_and_names() -> None:
    e = est(gpus=8, sharding="fsdp")
    assert set(e.breakdown) == set(TERMS)
    assert sum(e.breakdown.values()) == e.per_gpu_bytes
    assert all(isinstance(v, int) and v >= 0 for v in e.breakdown.values())
    assert e.assumptions and any("FlashAttention" in a for a in e.assumptions)
    a = allocator_bytes(e)
    assert a["active"] < a["reserved"] < e.per_gpu_bytes
    assert e.per_gpu_bytes - a["reserved"] == sum(e.breakdown[t] for t in NON_ALLOCATOR_TERMS)


def test_fsdp2_bf16_mixed_holds_16_bytes_per_param_sharded() -> None:
    P = L8B.params
    e = est(gpus=8, sharding="fsdp", precision="bf16-mixed")
    b = e.breakdown
    assert b["parameters"] == 4 * P // 8  # fp32 sharded params
    assert b["gradients"] == 4 * P // 8  # fp32 sharded grads (kept by the reduce-scatter stream)
    assert b["optimizer_states"] == 8 * P // 8  # exp_avg + exp_avg_sq fp32
    assert b["fp32_master"] == 0  # the sharded params ARE the fp32 copy
    assert e.model_states_bytes == 8 * (4 * P // 8 + 4 * P // 8 + 8 * P // 8)
    layer_bf16 = 2 * L8B.layer_params()
    root_bf16 = 2 * (P - L8B.num_layers * L8B.layer_params())
    assert b["gathered_params"] == 2 * layer_bf16 + root_bf16  # current + prefetched block + root


def test_pure_bf16_is_8_bytes_per_param() -> None:
    P = L8B.params
    b = est(gpus=1, sharding="none", precision="bf16", activation_checkpointing="full", seq_len=128).breakdown
    assert b["parameters"] == 2 * P and b["optimizer_states"] == 4 * P


def test_autocast_ddp_holds_bf16_weight_copies() -> None:
    b = est(gpus=2, sharding="ddp", precision="bf16-mixed", seq_len=256).breakdown
    P = L8B.params
    assert b["parameters"] == 4 * P and b["autocast_weight_cache"] == 2 * P
    assert b["comm_buckets"] == b["gradients"] == 4 * P  # DDP buckets duplicate the grads


def test_zero_stages_shard_what_they_should() -> None:
    P = L8B.params
    z1 = est(gpus=8, sharding="zero1", seq_len=256).breakdown
    z2 = est(gpus=8, sharding="zero2", seq_len=256).breakdown
    assert z1["parameters"] == z2["parameters"] == 2 * P  # bf16 params replicated
    assert z1["optimizer_states"] == z2["optimizer_states"] == 8 * P // 8
    assert z1["fp32_master"] == 4 * P // 8
    assert z2["gradients"] < z1["gradients"]


def test_hsdp_shards_within_group() -> None:
    P = L8B.params
    h = est(gpus=32, gpus_per_node=8, sharding="hsdp").breakdown
    f = est(gpus=32, gpus_per_node=8, sharding="fsdp").breakdown
    assert h["parameters"] == 4 * P // 8 and f["parameters"] == 4 * P // 32
    h4 = est(gpus=32, gpus_per_node=8, sharding="hsdp", shard_group=16).breakdown
    assert h4["parameters"] == 4 * P // 16


def test_lora_frozen_base_has_no_grads_or_optimizer_state() -> None:
    e = est(L7B, task="lora", gpus=1, sharding="none", precision="bf16", lora_rank=8, lora_targets=("q_proj", "v_proj"))
    trainable = 32 * 2 * 8 * 8192
    assert e.trainable_params == trainable
    assert e.breakdown["optimizer_states"] == 4 * trainable  # bf16 AdamW states, adapters only
    assert e.breakdown["parameters"] == 2 * L7B.params + 2 * trainable
    full = est(L7B, gpus=1, sharding="none", precision="bf16")
    assert e.per_gpu_bytes < full.per_gpu_bytes


def test_qlora_nf4_double_quant_bytes() -> None:
    # QLoRA paper: 4 bits + 8-bit absmax per 64 + fp32 per 256 absmax = 0.5 + 0.0159 B/param
    assert nf4_bytes_per_param() == pytest.approx(0.5 + 1 / 64 + 4 / (64 * 256))
    q = est(L7B, task="qlora", gpus=1, sharding="none", precision="bf16", lora_rank=8, lora_targets="qv")
    quantized = L7B.num_layers * L7B.layer_linear_params()
    rest = L7B.params - quantized
    adapters = 32 * 2 * 8 * 8192
    expected = int(nf4_bytes_per_param() * quantized + 2 * rest) + 2 * adapters
    assert q.breakdown["parameters"] == pytest.approx(expected, abs=2)
    assert q.breakdown["parameters"] < 0.3 * 2 * L7B.params


def test_activation_checkpointing_order_and_compile() -> None:
    kw = dict(gpus=8, seq_len=8192, micro_batch=2)
    none, sel, full = (est(activation_checkpointing=m, **kw).breakdown["activations"] for m in ("none", "selective", "full"))
    assert none > sel > full > 0
    # full AC keeps one hidden-state per layer: 2 bytes * h * tokens * layers (+ final norm)
    assert full >= 2 * 4096 * 16384 * 32
    eager = est(activation_checkpointing="none", **kw).breakdown["activations"]
    compiled = est(activation_checkpointing="none", compile=True, **kw).breakdown["activations"]
    assert compiled < eager


def test_no_s_squared_term() -> None:
    # FlashAttention: doubling the sequence (halving the batch) keeps activations the same
    a = est(activation_checkpointing="none", seq_len=4096, micro_batch=2).breakdown["activations"]
    b = est(activation_checkpointing="none", seq_len=8192, micro_batch=1).breakdown["activations"]
    assert a == b


def test_cross_entropy_for_128k_vocab_and_chunking() -> None:
    e = est(seq_len=8192, micro_batch=2, gpus=8)
    tokens, V = 16384, L8B.vocab_size
    assert e.breakdown["cross_entropy"] == 3 * 4 * tokens * V  # fp32 log-probs, their grad, nll grad
    assert e.breakdown["logits"] == 2 * tokens * V
    chunked = est(seq_len=8192, micro_batch=2, gpus=8, chunked_cross_entropy=True)
    assert chunked.breakdown["cross_entropy"] < e.breakdown["cross_entropy"]
    assert chunked.per_gpu_bytes < e.per_gpu_bytes


def test_offload_and_8bit_reduce_memory() -> None:
    base = est(gpus=8, seq_len=1024)
    opt = est(gpus=8, seq_len=1024, offload="optimizer")
    full = est(gpus=8, seq_len=1024, offload="full")
    assert opt.breakdown["optimizer_states"] == 0 and opt.per_gpu_bytes < base.per_gpu_bytes
    assert full.breakdown["parameters"] == 0 and full.per_gpu_bytes < opt.per_gpu_bytes
    q8 = est(gpus=8, seq_len=1024, optimizer="adamw-8bit")
    assert q8.breakdown["optimizer_states"] < base.breakdown["optimizer_states"] / 3


def test_context_and_nccl() -> None:
    one = est(gpus=1, sharding="none", seq_len=256)
    many = est(gpus=8, seq_len=256)
    assert one.breakdown["nccl_buffers"] == 0 and many.breakdown["nccl_buffers"] > 0
    assert one.breakdown["cuda_context"] > 0


def test_gradient_accumulation_and_activation_offload_knobs() -> None:
    plain = estimate_memory(L8B, ExtendedSetup(gpus=1, sharding="none", precision="bf16", seq_len=16384))
    accum = estimate_memory(L8B, ExtendedSetup(gpus=1, sharding="none", precision="bf16", seq_len=16384, grad_accumulation_steps=4))
    assert accum.per_gpu_bytes > plain.per_gpu_bytes
    off = estimate_memory(L8B, ExtendedSetup(gpus=1, sharding="none", precision="bf16", seq_len=16384, activation_offloading=True))
    assert off.breakdown["activations"] < plain.breakdown["activations"] / 4


def test_moe_and_gemma_run() -> None:
    moe = est(get_model("mixtral-8x7b"), gpus=16, seq_len=4096)
    assert moe.per_gpu_bytes > 0
    gemma = est(get_model("gemma-2-9b"), gpus=8, seq_len=4096)
    assert any("soft-capping" in a for a in gemma.assumptions)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(seq_len=0), "--seq-len"),
        (dict(micro_batch=-1), "--micro-batch"),
        (dict(gpus=0), "--gpus"),
        (dict(task="lora", lora_rank=0), "--lora-rank"),
        (dict(task="lora", lora_rank=5000), "larger than the hidden size"),
        (dict(sharding="hsdp", gpus=12, gpus_per_node=8), "does not divide"),
        (dict(sharding="hsdp", gpus=16, shard_group=3), "does not divide"),
        (dict(sharding="tp"), "--sharding"),
        (dict(task="lora", lora_targets=("q_proj", "bogus")), "unknown LoRA target"),
    ],
)
def test_bad_setups_raise_one_line(kw, message) -> None:
    with pytest.raises(GpuprovError, match=message) as info:
        est(**kw)
    assert "\n" not in str(info.value)


def xest(arch=L7B, **kw):
    return estimate_memory(arch, ExtendedSetup(**kw))


QLORA_2X = dict(task="qlora", lora_rank=64, seq_len=2048, micro_batch=4, gpus=2, sharding="fsdp",
                activation_checkpointing="full", precision="bf16", optimizer_impl="foreach")


def test_legacy_hf_loss_holds_fp32_logits() -> None:
    tokens, V = 2048 * 4, L7B.vocab_size
    hf, legacy, native = (xest(**QLORA_2X, loss_impl=k) for k in ("hf", "hf-legacy", "native"))
    # transformers < 4.45: fp32 logits (4 B) instead of bf16 (2 B) at the loss peak
    assert legacy.per_gpu_bytes - hf.per_gpu_bytes >= 2 * tokens * V
    assert legacy.breakdown["logits"] == 4 * tokens * V and hf.breakdown["logits"] == 2 * tokens * V
    assert any("hf-legacy" in a for a in legacy.assumptions)
    # kept through backward by the loop: the backward-of-the-top-block phase carries them as well
    phase_b = dict(QLORA_2X, micro_batch=1, seq_len=512)
    kept = xest(**phase_b, loss_impl="hf", lora_dropout=0.0)
    freed = xest(**phase_b, loss_impl="native", lora_dropout=0.0)
    assert kept.per_gpu_bytes >= freed.per_gpu_bytes
    assert native.per_gpu_bytes <= hf.per_gpu_bytes
    with pytest.raises(GpuprovError, match="loss implementation"):
        xest(**QLORA_2X, loss_impl="megatron")


def test_lora_dropout_keeps_input_copies_and_masks() -> None:
    # no AC: every layer's dropped-out inputs stay saved; (bf16 copy + bool mask) x in_features per target
    kw = dict(task="lora", lora_rank=16, seq_len=1024, gpus=1, sharding="none", activation_checkpointing="none",
              precision="bf16", lora_targets=("q_proj", "v_proj"))
    off, on = xest(**kw), xest(**kw, lora_dropout=0.1)
    expected = 1024 * L7B.num_layers * (2 + 1) * 2 * L7B.hidden_size
    assert on.breakdown["activations"] - off.breakdown["activations"] == expected
    assert any("dropout" in a for a in on.assumptions)


def test_bnb_quant_state_is_neither_sharded_nor_offloaded() -> None:
    two, four = xest(**QLORA_2X), xest(**{**QLORA_2X, "gpus": 4})
    quantized = L7B.num_layers * L7B.layer_linear_params()
    packed = quantized // 2  # 4-bit codes: the part FSDP shards
    absmax = (nf4_bytes_per_param() - 0.5) * quantized
    assert two.breakdown["parameters"] - four.breakdown["parameters"] == pytest.approx(
        (packed + 2 * (L7B.params - quantized)) / 4 + 2 * two.trainable_params / 4, rel=1e-3)
    off = xest(**{**QLORA_2X, "offload": "full"})
    assert off.breakdown["parameters"] == pytest.approx(absmax, rel=1e-6)
    assert off.breakdown["gradients"] == 0 and off.breakdown["optimizer_states"] == 0


def test_reserved_reading_cannot_exceed_the_gpu() -> None:
    e = xest(**{**QLORA_2X, "micro_batch": 16})
    outside = sum(e.breakdown[t] for t in NON_ALLOCATOR_TERMS)
    uncapped = allocator_bytes(e)
    small = uncapped["reserved"] + outside - uncapped["reserved"] // 20  # less than the demand
    capped = allocator_bytes(e, small)
    assert capped["active"] == uncapped["active"]
    assert capped["reserved"] == max(uncapped["active"], small - outside) < uncapped["reserved"]
    # a big GPU changes nothing; per_gpu_bytes (the planning figure) never depends on it
    assert allocator_bytes(e, 10 * e.per_gpu_bytes) == uncapped


def test_selective_ac_follows_the_matmul_parity_of_the_block():
    """torchtitan's SAC saves odd-numbered aten.mm outputs per block: LoRA's extra matmuls shift
    the parity (more is saved), biased projections run as addmm (neither counted nor saved)."""
    from gpuprov.sizing.memory import selective_layer_bytes_per_token

    arch = get_model("llama-2-7b")
    h, f, a, heads, r = 4096, 11008, 2, 32, 16
    extra = 4 * heads  # fp32 logsumexp per head
    # full: q, v, gate, down outputs (mm 1, 3, 5, 7) + block input + SDPA output
    assert selective_layer_bytes_per_token(arch, a) == a * (h + h + h + h + f + h) + extra
    # all-linear LoRA: 21 matmuls; saved q, q.B, k.A, v, v.B, o.A, gate, gate.B, up.A, down, down.B
    all_linear = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    lora = selective_layer_bytes_per_token(arch, a, all_linear, r)
    assert lora == a * (h + h + (h + h + r + h + h + r + f + f + r + h + h)) + extra
    # qwen2: q/k/v carry biases (addmm): the counted matmuls are o, gate, up, down -> o and up saved
    qwen = get_model("qwen2.5-7b")
    assert selective_layer_bytes_per_token(qwen, a) == (
        a * (qwen.hidden_size + qwen.q_dim + qwen.hidden_size + qwen.intermediate_size)
        + 4 * qwen.num_attention_heads
    )


# ---------------------------------------------------------------------------- stack semantics (framework presets)

LORA_FSDP = dict(task="lora", lora_rank=16, seq_len=4096, micro_batch=1, gpus=8, sharding="fsdp",
                 activation_checkpointing="none", precision="bf16-mixed")


def test_autocast_over_fp32_params_under_fsdp_costs_fp32_base_gathers_and_residual() -> None:
    """Lightning bf16-mixed (MixedPrecision(param_dtype=fp32) + torch.autocast): the frozen base stays fp32,
    FSDP gathers fp32, the residual stream and norms are fp32 and every linear saves its own casts."""
    from gpuprov.sizing.memory import autocast_extra_bytes_per_token

    policy = xest(L8B, **LORA_FSDP)
    amp = xest(L8B, **LORA_FSDP, autocast_fp32_params=True)
    base_bytes = 2 * L8B.params  # bf16 base under a MixedPrecision policy
    assert amp.breakdown["parameters"] - policy.breakdown["parameters"] == pytest.approx(base_bytes / 8, rel=0.01)
    assert amp.breakdown["gathered_params"] == pytest.approx(2 * policy.breakdown["gathered_params"], rel=0.01)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    extra = 4096 * L8B.num_layers * autocast_extra_bytes_per_token(L8B, targets)
    assert amp.breakdown["activations"] - policy.breakdown["activations"] >= extra
    # no AC: every block's bf16 weight casts are saved until its backward
    assert amp.breakdown["autocast_weight_cache"] >= 2 * L8B.num_layers * L8B.layer_linear_params()
    assert amp.per_gpu_bytes > 1.3 * policy.per_gpu_bytes  # the 30-50% underestimate, closed
    assert any("autocast over fp32" in a for a in amp.assumptions)
    # only bf16-mixed means autocast: pure bf16 ignores the flag
    pure = dict(LORA_FSDP, precision="bf16")
    assert xest(L8B, **pure, autocast_fp32_params=True).per_gpu_bytes == xest(L8B, **pure).per_gpu_bytes


def test_whole_model_compile_without_upcast_keeps_one_logit_sized_gradient() -> None:
    kw = dict(gpus=8, sharding="fsdp", seq_len=8192, compile=True, loss_impl="native")
    tokens, V = 8192, L8B.vocab_size
    block = xest(L8B, **kw)
    whole = xest(L8B, **kw, compile_scope="model")
    whole_bf16 = xest(L8B, **kw, compile_scope="model", loss_upcast=False)
    assert block.breakdown["cross_entropy"] == 3 * 4 * tokens * V  # eager loss after per-block compile
    assert whole.breakdown["cross_entropy"] == 4 * tokens * V  # fused in the graph: one fp32 gradient
    assert whole_bf16.breakdown["cross_entropy"] == 2 * tokens * V
    assert whole_bf16.breakdown["logits"] == 2 * tokens * V  # the graph saves its input logits
    # an eager loss saves only its log-softmax: logits the loop deleted are gone at the start of backward
    assert block.breakdown["logits"] == 0
    assert xest(L8B, **{**kw, "compile": False}, loss_upcast=False).breakdown["cross_entropy"] == 3 * 2 * tokens * V


def test_fsdp2_separate_embedding_units_leave_only_the_head_gathered() -> None:
    kw = dict(gpus=8, sharding="fsdp", seq_len=2048, activation_checkpointing="full")
    root, apart = xest(L8B, **kw), xest(L8B, **kw, shard_embeddings=True)
    assert root.breakdown["gathered_params"] - apart.breakdown["gathered_params"] == 2 * L8B.embedding_params
    tied = get_model("llama-3.2-1b")  # tied embeddings: one unit either way
    assert xest(tied, **kw).per_gpu_bytes == xest(tied, **kw, shard_embeddings=True).per_gpu_bytes


def test_fsdp1_flat_params_mixing_frozen_and_adapters_allocate_whole_gradients() -> None:
    kw = dict(task="lora", lora_rank=8, lora_targets=("q_proj", "v_proj"), seq_len=1304, gpus=2, sharding="fsdp",
              activation_checkpointing="full", precision="bf16", fsdp_version=1)
    plain, mixed = xest(**kw), xest(**kw, fsdp1_frozen_grads=True)
    frozen_blocks = 2 * L7B.num_layers * L7B.layer_params()
    assert mixed.breakdown["gradients"] - plain.breakdown["gradients"] == pytest.approx(frozen_blocks / 2, rel=0.01)
    assert xest(**{**kw, "fsdp_version": 2}, fsdp1_frozen_grads=True).per_gpu_bytes == xest(**{**kw, "fsdp_version": 2}).per_gpu_bytes


def test_defer_grad_sync_accumulates_unsharded_gradients() -> None:
    kw = dict(gpus=8, sharding="fsdp", seq_len=2048, activation_checkpointing="full", fsdp_version=1,
              grad_accumulation_steps=4)
    synced, nosync = xest(L8B, **kw), xest(L8B, **kw, defer_grad_sync=True)
    assert nosync.breakdown["gradients"] == pytest.approx(8 * synced.breakdown["gradients"], rel=0.01)
    # FSDP2 without gradient sync (set_requires_gradient_sync(False)) keeps unsharded_accumulated_grad alike
    v2 = {**kw, "fsdp_version": 2}
    assert xest(L8B, **v2, defer_grad_sync=True).breakdown["gradients"] == nosync.breakdown["gradients"]
    one_step = {**kw, "grad_accumulation_steps": 1}
    assert xest(L8B, **one_step, defer_grad_sync=True).per_gpu_bytes == xest(L8B, **one_step).per_gpu_bytes
    assert any("without gradient sync" in a for a in nosync.assumptions)


def test_fp32_model_logits_only_without_chunked_output() -> None:
    kw = dict(gpus=1, sharding="none", precision="bf16", seq_len=4096, micro_batch=2, loss_impl="hf",
              activation_checkpointing="full")
    tokens, V = 8192, L8B.vocab_size
    assert xest(L8B, **kw, fp32_logits=True).breakdown["logits"] == 4 * tokens * V
    assert xest(L8B, **kw).breakdown["logits"] == 2 * tokens * V
    chunked = dict(kw, chunked_cross_entropy=True)
    assert xest(L8B, **chunked, fp32_logits=True).per_gpu_bytes == xest(L8B, **chunked).per_gpu_bytes


def test_fsdp1_mixed_precision_casts_a_low_precision_shard_first() -> None:
    kw = dict(gpus=8, sharding="fsdp", seq_len=2048)
    v1, v2 = xest(L8B, **kw, fsdp_version=1), xest(L8B, **kw)
    assert v1.breakdown["gathered_params"] > v2.breakdown["gathered_params"]
    assert any("FSDP1" in a for a in v1.assumptions) and any("FSDP2" in a for a in v2.assumptions)
    with pytest.raises(GpuprovError, match="--fsdp-version"):
        xest(L8B, **kw, fsdp_version=3)
    with pytest.raises(GpuprovError, match="--compile-scope"):
        xest(L8B, **kw, compile_scope="graph")


def test_kbit_fp32_casts_follow_peft_and_bitsandbytes() -> None:
    """peft's prepare_model_for_kbit_training casts every non-4-bit parameter to fp32; bitsandbytes'
    Linear4bit then returns fp32 outputs, the residual stream is fp32, and without autocast the head
    writes fp32 logits."""
    from gpuprov.sizing.activations import kbit_extra_bytes_per_token

    kw = dict(task="qlora", gpus=1, sharding="none", seq_len=2048, micro_batch=4, activation_checkpointing="full",
              precision="bf16", lora_rank=16)
    plain = estimate_memory(L8B, TrainSetup(**kw)).breakdown
    cast = estimate_memory(L8B, TrainSetup(**kw, kbit_fp32_casts=True)).breakdown
    quantized = L8B.num_layers * L8B.layer_linear_params()
    # the non-4-bit parameters (embeddings, head, norms) go from 2 to 4 bytes; adapters from bf16 to fp32
    from gpuprov.sizing.arch import resolve_lora_targets

    adapters = L8B.lora_params(16, resolve_lora_targets(TrainSetup().lora_targets))
    assert cast["parameters"] - plain["parameters"] == pytest.approx(2 * (L8B.params - quantized) + 2 * adapters, rel=1e-6)
    tokens = 2048 * 4
    assert cast["logits"] == 2 * plain["logits"] == tokens * 4 * L8B.vocab_size  # fp32 head, no autocast
    assert cast["activations"] > plain["activations"] + tokens * 2 * L8B.hidden_size * (L8B.num_layers - 1)
    # under autocast SDPA saves bf16 copies: only the MLP's fp32 tensors are extra; the flag is QLoRA's alone
    assert kbit_extra_bytes_per_token(L8B, autocast=True) == 6 * L8B.intermediate_size
    assert kbit_extra_bytes_per_token(L8B, autocast=False) > kbit_extra_bytes_per_token(L8B, autocast=True)
    lora = dict(kw, task="lora")
    assert estimate_memory(L8B, TrainSetup(**lora, kbit_fp32_casts=True)).breakdown == \
        estimate_memory(L8B, TrainSetup(**lora)).breakdown


def test_fsdp1_gradient_buffers_follow_flat_parameter_views() -> None:
    """FSDP1: a unit's view gradients and the flat gradient SplitWithSizesBackward cats from them coexist;
    with autocast over fp32 parameters (no MixedPrecision policy) the reduce dtype is fp32, so no cast."""
    from gpuprov.sizing.memory import _fsdp1_grad_buffers

    unit = L7B.layer_params()
    assert _fsdp1_grad_buffers(unit, 4, 4, 8) == unit * 8 + unit * 4 // 8
    assert _fsdp1_grad_buffers(unit, 4, 2, 8) == unit * 10 + unit * 2 // 8  # + the bf16 reduce copy
    kw = dict(gpus=16, sharding="fsdp", seq_len=4096, activation_checkpointing="full", fsdp_version=1)
    auto = estimate_memory(L7B, TrainSetup(**kw, autocast_fp32_params=True)).breakdown
    assert auto["reduce_scatter_buffers"] == _fsdp1_grad_buffers(unit, 4, 4, 16)  # the peak is in backward
    mp = estimate_memory(L7B, TrainSetup(**kw)).breakdown  # accelerate's MixedPrecision: bf16 grads, bf16 reduce
    assert mp["reduce_scatter_buffers"] == _fsdp1_grad_buffers(unit, 2, 2, 16)


def test_autocast_cast_cache_does_not_shard_only_under_fsdp2() -> None:
    """autocast caches bf16 casts of leaf fp32 parameters until its region exits (aten autocast_mode.cpp
    cached_cast): FSDP2's unsharded parameters are leaves, FSDP1's are views of the flat parameter."""
    kw = dict(sharding="fsdp", precision="bf16-mixed", activation_checkpointing="full", seq_len=2048,
              autocast_fp32_params=True)
    full_cache = 2 * L7B.num_layers * L7B.layer_linear_params() + 2 * L7B.lm_head_params
    by_gpus = {g: estimate_memory(L7B, TrainSetup(gpus=g, fsdp_version=2, **kw)) for g in (16, 64)}
    for e in by_gpus.values():  # the whole model's bf16 casts, the same on 16 and 64 GPUs
        assert e.breakdown["autocast_weight_cache"] == full_cache
    assert any("end of forward" in a for a in by_gpus[16].assumptions)
    # FSDP1 under the same autocast: only the head's cast, saved by autograd until its backward
    for g in (16, 64):
        fsdp1 = estimate_memory(L7B, TrainSetup(gpus=g, fsdp_version=1, **kw))
        assert fsdp1.breakdown["autocast_weight_cache"] == 2 * L7B.lm_head_params
    # FSDP2 MixedPrecisionPolicy(param_dtype=bf16): no autocast, no cache
    mp = estimate_memory(L7B, TrainSetup(gpus=16, fsdp_version=2, **{**kw, "autocast_fp32_params": False}))
    assert mp.breakdown["autocast_weight_cache"] == 0
    # LoRA: only the adapters require grad, so the frozen base's casts are never cached (the head's is saved)
    lora = estimate_memory(L7B, TrainSetup(gpus=16, fsdp_version=2, task="lora", **kw))
    assert lora.breakdown["autocast_weight_cache"] <= 2 * L7B.lm_head_params + 2 * lora.trainable_params
    # without recompute autograd saves the same casts: counted once
    no_ac = estimate_memory(L7B, TrainSetup(gpus=16, fsdp_version=2, **{**kw, "activation_checkpointing": "none"}))
    assert no_ac.breakdown["autocast_weight_cache"] == full_cache
