"""Precise mode: a simulated step on fake tensors, checked against a real CPU run of the same step.

Tiny Llama-shaped configs keep every test to a few seconds on one shared core.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest

from gpuprov.errors import GpuprovError
from gpuprov.sizing.types import TrainSetup

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from gpuprov.sizing import precise, precise_step  # noqa: E402

pytestmark = pytest.mark.torch

OVERHEAD_TERMS = ("cuda_context", "allocator_fragmentation", "nccl_buffers")


def tiny(layers: int = 2, hidden: int = 256, vocab: int = 1000, **extra) -> SimpleNamespace:
    cfg = dict(
        model_type="llama", hidden_size=hidden, intermediate_size=688, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=vocab,
        max_position_embeddings=8192, **extra,
    )
    return SimpleNamespace(name="tiny-llama", hf_config=cfg, num_layers=layers)


def setup(**kw) -> TrainSetup:
    base = dict(seq_len=512, micro_batch=1, gpus=1, sharding="none", activation_checkpointing="none")
    base.update(kw)
    return TrainSetup(**base)


def tensor_bytes(est) -> int:
    return sum(v for k, v in est.breakdown.items() if k not in OVERHEAD_TERMS)


def measured_real_peak(arch, s: TrainSetup) -> int:
    """Run the same step on real CPU tensors; peak = live bytes before the step + the highest
    running sum of the allocator's own [memory] events recorded by the profiler."""
    from torch.profiler import ProfilerActivity, profile

    step = precise.build_step(arch, s, [])
    step.warm_up_optimizer()
    live = list(step.model.parameters()) + list(step.model.buffers()) + [step.ids, step.labels]
    live += [v for st in step.opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in live}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step.run()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return sum(storages.values()) + peak


@pytest.mark.parametrize(
    "kw",
    [
        dict(seq_len=1024),
        # the longer steps (5-10 s each) run with the slow tests
        pytest.param(dict(seq_len=1024, activation_checkpointing="selective", micro_batch=2), marks=pytest.mark.slow),
        pytest.param(dict(seq_len=1024, activation_checkpointing="full"), marks=pytest.mark.slow),
        dict(precision="fp32"),
        dict(task="lora", activation_checkpointing="selective"),
        dict(task="qlora"),
        dict(optimizer="adamw-8bit", seq_len=256),
        pytest.param(dict(chunked_cross_entropy=True, seq_len=1024), marks=pytest.mark.slow),
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_simulation_matches_a_real_cpu_step(kw):
    torch.set_num_threads(1)  # the CPU flash kernel's per-thread scratch stays small
    arch, s = tiny(), setup(**kw)
    est = precise.estimate_precise(arch, s)
    real = measured_real_peak(arch, s)
    # The simulation rounds each tensor to 512 B (CUDA allocator); nothing else may differ.
    assert abs(tensor_bytes(est) - real) / real < 0.02, (tensor_bytes(est), real, est.breakdown)


def test_peak_grows_with_seq_len_and_micro_batch():
    arch = tiny()
    base = precise.estimate_precise(arch, setup(seq_len=512, sharding="fsdp", gpus=2))
    longer = precise.estimate_precise(arch, setup(seq_len=2048, sharding="fsdp", gpus=2))
    wider = precise.estimate_precise(arch, setup(seq_len=512, micro_batch=4, sharding="fsdp", gpus=2))
    assert longer.per_gpu_bytes > base.per_gpu_bytes
    assert wider.per_gpu_bytes > base.per_gpu_bytes


def test_activations_are_linear_in_seq_len_no_s2_scores():
    # FlashAttention memory: 4x the tokens may cost at most ~4x the activations, never 16x.
    arch = tiny(layers=1)
    short = precise.estimate_precise(arch, setup(seq_len=1024))
    long = precise.estimate_precise(arch, setup(seq_len=4096))
    act = lambda e: sum(  # noqa: E731
        e.breakdown.get(k, 0) for k in ("activations", "activation_transient", "logits", "cross_entropy")
    )
    assert act(long) < 4.5 * act(short)


def test_loss_buffers_are_split_out_as_three_fp32_logit_tensors():
    # fp32 upcast of the logits, its log-softmax (saved) and the gradient at the start of
    # backward: the loss end is reported under the analytic model's cross_entropy term.
    arch, s = tiny(vocab=4000), setup(seq_len=2048)
    est = precise.estimate_precise(arch, s)
    fp32_logits = s.seq_len * 4000 * 4
    assert abs(est.breakdown["cross_entropy"] - 3 * fp32_logits) < 0.05 * fp32_logits, est.breakdown


def test_chunked_cross_entropy_saves_the_transient_upcasts():
    arch, s = tiny(vocab=4000), setup(seq_len=2048)
    plain = precise.estimate_precise(arch, s)
    chunked = precise.estimate_precise(arch, replace(s, chunked_cross_entropy=True))
    fp32_logits = s.seq_len * 4000 * 4
    assert chunked.breakdown["cross_entropy"] < plain.breakdown["cross_entropy"] - fp32_logits


def test_compiled_loss_and_activation_offloading_lower_the_peak():
    arch, s = tiny(vocab=4000), setup(seq_len=2048, chunked_cross_entropy=True)
    eager = precise.estimate_precise(arch, s)
    compiled = precise.estimate_precise(arch, replace(s, compile=True))
    assert compiled.breakdown["cross_entropy"] < eager.breakdown["cross_entropy"]
    offloaded = precise.estimate_precise(arch, replace(s, activation_offloading=True))  # a TrainSetup field now
    assert offloaded.breakdown["activations"] < 0.1 * eager.breakdown["activations"]
    assert any("offloading" in a for a in offloaded.assumptions)


@pytest.mark.slow
def test_peak_shrinks_with_more_fsdp_gpus():
    arch = tiny(layers=4)
    ests = [precise.estimate_precise(arch, setup(sharding="fsdp", gpus=n, seq_len=256)) for n in (1, 2, 4, 8)]
    peaks = [tensor_bytes(e) for e in ests]  # (1 GPU has no NCCL buffers: compare tensors)
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < peaks[0], peaks
    assert ests[1].per_gpu_bytes > ests[2].per_gpu_bytes > ests[3].per_gpu_bytes
    assert ests[3].breakdown["parameters"] * 7 < ests[0].breakdown["parameters"]


def test_lora_has_far_fewer_optimizer_and_gradient_bytes_than_full():
    arch = tiny()
    full = precise.estimate_precise(arch, setup())
    lora = precise.estimate_precise(arch, setup(task="lora", lora_rank=8, lora_targets=("q_proj", "v_proj")))
    assert lora.trainable_params < full.trainable_params / 20
    assert lora.breakdown["optimizer_states"] * 20 < full.breakdown["optimizer_states"]
    assert lora.model_states_bytes < full.model_states_bytes / 3


@pytest.mark.slow
def test_qlora_stores_frozen_linears_as_nf4():
    arch = tiny(layers=4, hidden=512, vocab=256)
    lora = precise.estimate_precise(arch, setup(task="lora"))
    qlora = precise.estimate_precise(arch, setup(task="qlora"))
    assert qlora.breakdown["parameters"] < 0.5 * lora.breakdown["parameters"]
    assert any("NF4" in a for a in qlora.assumptions)
    assert precise.nf4_bytes(4096 * 4096) == 4096 * 4096 // 2 + 4096 * 4096 // 64 + 4 * 1024


def test_eight_bit_adam_states_are_a_quarter():
    arch = tiny()
    fp32 = precise.estimate_precise(arch, setup())
    int8 = precise.estimate_precise(arch, setup(optimizer="adamw-8bit"))
    ratio = int8.breakdown["optimizer_states"] / fp32.breakdown["optimizer_states"]
    assert 0.25 <= ratio < 0.3, ratio


def test_zero_and_ddp_partitioning():
    arch = tiny()
    ddp = precise.estimate_precise(arch, setup(sharding="ddp", gpus=4))
    zero2 = precise.estimate_precise(arch, setup(sharding="zero2", gpus=4))
    assert ddp.breakdown["comm_buckets"] > 0
    assert zero2.breakdown["optimizer_states"] * 3 < ddp.breakdown["optimizer_states"]


def test_progress_reports_stages_in_order_and_finishes():
    seen: list[tuple[str, float]] = []
    precise.estimate_precise(tiny(), setup(sharding="fsdp", gpus=2), progress=lambda s, f: seen.append((s, f)))
    fractions = [f for _, f in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    stages = [s for s, _ in seen]
    assert {"building model", "forward", "backward", "optimizer step", "done"} <= set(stages)


def test_estimate_seconds_scales_with_depth():
    s = setup()
    assert 0 < precise.estimate_seconds(tiny(layers=2), s) < precise.estimate_seconds(tiny(layers=32), s)


def test_bad_input_is_one_clear_error():
    with pytest.raises(GpuprovError, match="MoE"):
        precise.estimate_precise(tiny(num_local_experts=8, num_experts_per_tok=2), setup())
    with pytest.raises(GpuprovError, match="seq-len"):
        precise.estimate_precise(tiny(), replace(setup(), seq_len=0))
    with pytest.raises(GpuprovError, match="does not divide"):
        precise.estimate_precise(tiny(), setup(sharding="hsdp", gpus=12, shard_group=8))
    with pytest.raises(GpuprovError, match="hf_config"):
        precise.estimate_precise(SimpleNamespace(name="x", hf_config=None), setup())


def test_missing_torch_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft -> ImportError
    with pytest.raises(GpuprovError, match=r"pip install torch transformers peft \(the \[precise\] extra"):
        precise.estimate_precise(tiny(), setup(task="lora"))
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(GpuprovError, match=r"pip install torch transformers peft \(the \[precise\] extra"):
        precise.estimate_precise(tiny(), setup())


def test_hsdp_shards_like_fsdp_over_its_group_and_offload_moves_states_off_gpu():
    arch = tiny()
    hsdp = precise.estimate_precise(arch, setup(sharding="hsdp", gpus=16, shard_group=4))
    fsdp4 = precise.estimate_precise(arch, setup(sharding="fsdp", gpus=4))
    assert tensor_bytes(hsdp) == tensor_bytes(fsdp4)
    assert hsdp.model_states_bytes == 4 * fsdp4.model_states_bytes  # 4 replicas of the shards
    off = precise.estimate_precise(arch, setup(sharding="fsdp", gpus=4, offload="optimizer"))
    assert "optimizer_states" not in off.breakdown and off.per_gpu_bytes < fsdp4.per_gpu_bytes


def test_building_the_model_leaves_the_catalog_config_untouched():
    """transformers rewrites rope_scaling in place; the catalog's cached copy must not change,
    or every plan rendered after a precise run differs (bundles drift)."""
    from gpuprov.catalog.models import get_model
    import copy as _copy

    arch = get_model("llama-3.1-8b")
    before = _copy.deepcopy(arch.hf_config)
    precise_step._build_config(arch, setup())
    assert arch.hf_config == before
    assert get_model("llama-3.1-8b").hf_config == before


@pytest.mark.slow
def test_replicated_qlora_base_is_left_out_of_fsdp_and_matches_the_analytic_flag():
    """gpuprov's trainer keeps the NF4 base whole on every GPU; precise mode simulates the same."""
    from gpuprov.sizing.memory import ExtendedSetup, estimate_memory

    arch = tiny(layers=4, hidden=512, vocab=256)
    common = dict(seq_len=512, micro_batch=1, gpus=4, sharding="fsdp", activation_checkpointing="none", task="qlora")
    sharded = precise.estimate_precise(arch, ExtendedSetup(**common))
    replicated = precise.estimate_precise(arch, ExtendedSetup(**common, qlora_base_replicated=True))
    nf4_total = 4 * sum(precise.nf4_bytes(n) for n in (512 * 512, 512 * 256, 512 * 256, 512 * 512,
                                                      3 * 512 * 688))
    grown = replicated.breakdown["parameters"] - sharded.breakdown["parameters"]
    # Replicating adds three quarters of the NF4 base on each of 4 GPUs (within packing slack).
    assert grown == pytest.approx(0.75 * nf4_total, rel=0.05)


def test_stack_knobs_change_the_simulated_step_as_the_analytic_model_says():
    """Presets precise mode can simulate: fp32 base under autocast, no loss upcast, logits kept by the loop."""
    arch = tiny(vocab=4000)
    lora = setup(task="lora", seq_len=1024, loss_impl="native")
    policy = precise.estimate_precise(arch, lora)
    amp = precise.estimate_precise(arch, replace(lora, autocast_fp32_params=True))
    # the frozen base is stored in fp32 instead of bf16: twice the parameter bytes
    assert amp.breakdown["parameters"] > 1.8 * policy.breakdown["parameters"], (amp.breakdown, policy.breakdown)
    assert any("autocast over fp32" in a for a in amp.assumptions)
    s = setup(seq_len=2048, precision="bf16", loss_impl="native")
    upcast = precise.estimate_precise(arch, s)
    bf16_loss = precise.estimate_precise(arch, replace(s, loss_upcast=False))
    assert bf16_loss.breakdown["cross_entropy"] < 0.7 * upcast.breakdown["cross_entropy"]
    kept = precise.estimate_precise(arch, replace(s, loss_impl="hf"))
    assert kept.per_gpu_bytes >= upcast.per_gpu_bytes


def test_separate_embedding_units_lower_the_fsdp_peak_as_the_analytic_model_says():
    from gpuprov.catalog.models import get_model
    from gpuprov.sizing.memory import estimate_memory

    arch = tiny(vocab=32000)  # untied: embeddings and head are large next to the blocks
    s = setup(sharding="fsdp", gpus=4, seq_len=256, activation_checkpointing="full", loss_impl="native")
    root = precise.estimate_precise(arch, s)
    apart = precise.estimate_precise(arch, replace(s, shard_embeddings=True))
    assert tensor_bytes(apart) < tensor_bytes(root), (apart.breakdown, root.breakdown)
    assert any("units of their own" in a for a in apart.assumptions)
    # the analytic model agrees on the direction for a catalog model of the same layout
    l8 = get_model("llama-3.1-8b")
    assert estimate_memory(l8, replace(s, shard_embeddings=True)).per_gpu_bytes < estimate_memory(l8, s).per_gpu_bytes
