"""TP / CP / PP as per-GPU memory terms: each dimension moves the terms it should, and bad layouts fail."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from gpuprov.catalog.models import get_model
from gpuprov.errors import GpuprovError
from gpuprov.sizing import parallel
from gpuprov.sizing.memory import estimate_memory
from gpuprov.sizing.types import TrainSetup

L70 = get_model("llama-3.1-70b")
L8 = get_model("llama-3.1-8b")


def _ext(**kw):
    from gpuprov.sizing.memory import ExtendedSetup

    kw.setdefault("sharding", "fsdp")
    kw.setdefault("activation_checkpointing", "full")
    return ExtendedSetup(**kw)


def est(arch=L70, **kw):
    kw.setdefault("sharding", "fsdp")
    return estimate_memory(arch, TrainSetup(**kw))


def test_tp_splits_weights_but_not_norms() -> None:
    # Same FSDP degree (8) with and without TP 8: the TP run holds 1/8 of the linears, all norms.
    base = est(gpus=8).breakdown
    tp = est(gpus=64, tp=8).breakdown
    P, L, h = L70.params, L70.num_layers, L70.hidden_size
    norms = 2 * h * L + h
    tp_params = (P - norms) / 8 + norms
    assert tp["parameters"] == pytest.approx(base["parameters"] * tp_params / P, rel=1e-6)
    assert tp["optimizer_states"] == pytest.approx(base["optimizer_states"] * tp_params / P, rel=1e-6)
    # FSDP's gathered block shrinks by the TP share of one block
    assert tp["gathered_params"] < base["gathered_params"] / 7


def test_sequence_parallel_splits_activations_and_gathered_inputs_stay_whole() -> None:
    for ac in ("none", "selective", "full"):
        base = est(gpus=8, activation_checkpointing=ac).breakdown
        tp = est(gpus=64, tp=8, activation_checkpointing=ac).breakdown
        assert tp["activations"] == pytest.approx(base["activations"] / 8, rel=1e-3)
    # AC none: every block keeps its gathered attention + MLP inputs at full sequence
    none = est(gpus=64, tp=8, activation_checkpointing="none", seq_len=4096)
    per_layer = 4096 * 2 * 2 * L70.hidden_size * (1 - 1 / 8)
    head = 4096 * 2 * L70.hidden_size * (1 - 1 / 8)  # the output head's gathered final-norm output
    assert none.breakdown["tp_gathered_inputs"] == pytest.approx(per_layer * L70.num_layers + head, rel=1e-6)
    # full AC: only the block being recomputed (if the peak is in backward), never all layers
    full = est(gpus=64, tp=8, activation_checkpointing="full").breakdown
    assert full["tp_gathered_inputs"] <= per_layer + 1


def test_loss_parallel_shards_logits() -> None:
    base = est(gpus=8, activation_checkpointing="full").breakdown
    tp = est(gpus=64, tp=8, activation_checkpointing="full").breakdown
    # loss_parallel's own backward (torch/distributed/tensor/parallel/loss.py) holds four fp32 copies of the
    # vocab shard where F.cross_entropy's log-softmax + nll backward holds three
    assert tp["cross_entropy"] == pytest.approx(base["cross_entropy"] / 8 * 4 / 3, rel=1e-3)


def test_tp_backward_holds_full_sequence_gradients() -> None:
    # large local batch: the peak moves into a block's backward once the loss is chunked and compiled
    kw = dict(gpus=64, tp=8, seq_len=8192, micro_batch=16, loss_impl="native", compile=True, compile_loss=True,
              chunked_cross_entropy=True)
    tp = estimate_memory(L70, _ext(**kw))
    full = 8192 * 16 * 2 * L70.hidden_size * (1 - 1 / 8)
    assert parallel.tp_backward_buffers(L70, _ext(**kw), 8192 * 16, 2) == int(3 * full)
    assert tp.breakdown["tp_backward_buffers"] in (0, int(3 * full))
    assert parallel.tp_backward_buffers(L70, _ext(gpus=8), 8192, 2) == 0  # no TP, no such buffers


def test_cp_splits_the_sequence_and_adds_ring_buffers() -> None:
    base = est(arch=L8, gpus=8, seq_len=32768, activation_checkpointing="full").breakdown
    cp = est(arch=L8, gpus=8, cp=4, seq_len=32768 * 4, activation_checkpointing="full").breakdown
    # 4x the sequence over 4 CP ranks: the same tokens per rank
    assert cp["activations"] == pytest.approx(base["activations"], rel=1e-3)
    assert cp["parameters"] == base["parameters"]  # CP ranks are FSDP ranks: weights unchanged
    assert base.get("cp_ring_buffers", 0) == 0
    q, kv = L8.q_dim, L8.q_dim  # GQA K/V repeated to the query heads before SDPA
    local = 32768
    setup = TrainSetup(gpus=8, cp=4, seq_len=32768 * 4, sharding="fsdp")
    ring = parallel.ring_buffers(L8, setup, 32768 * 4, 2)
    assert ring == int(local * (2 * 2 * 2 * kv + 4 * (q + 2 * kv) + 2 * 4 * 2 * kv))
    assert cp["cp_ring_buffers"] in (0, ring)  # held in the backward of a block only
    # a compiled chunked loss keeps the logits small: the peak moves to a block's backward
    long = estimate_memory(L8, _ext(gpus=8, cp=8, seq_len=262144, loss_impl="native", compile=True, compile_loss=True,
                                    chunked_cross_entropy=True))
    assert long.breakdown["cp_ring_buffers"] == parallel.ring_buffers(L8, _ext(gpus=8, cp=8, seq_len=262144), 262144, 2)


def test_pp_first_stage_holds_in_flight_micro_batches() -> None:
    from gpuprov.sizing.memory import ExtendedSetup

    def run(pp: int, accum: int):
        s = ExtendedSetup(gpus=8 * pp, tp=8, pp=pp, sharding="fsdp", activation_checkpointing="none",
                          grad_accumulation_steps=accum)
        return estimate_memory(L70, s)

    flat = run(1, 8).breakdown
    staged = run(4, 8)
    # 20 layers x 4 micro-batches in flight on the first stage == 80 layers x 1
    assert staged.breakdown["activations"] == pytest.approx(flat["activations"], rel=0.02)
    assert "pipeline stage" in next(a for a in staged.assumptions if a.startswith("peak"))
    few = run(4, 2).breakdown  # only 2 micro-batches: half the in-flight activations
    assert few["activations"] == pytest.approx(staged.breakdown["activations"] / 2, rel=0.02)
    assert staged.breakdown["parameters"] < flat["parameters"] / 3
    # pipelining keeps every output of the step (output_chunks: 8 by the 1F1B phase's end on the first stage)
    # and a receive buffer per micro-batch for the output's gradient
    assert staged.breakdown["pp_stage_outputs"] == int((8 + 8) * 4096 / 8 * L70.hidden_size * 2)
    assert flat.get("pp_stage_outputs", 0) == 0


L405 = get_model("llama-3.1-405b")


def _piped(schedule: str, **kw):
    kw = dict(dict(gpus=512, tp=8, pp=8, seq_len=8192, micro_batch=4, grad_accumulation_steps=8, sharding="fsdp",
                   activation_checkpointing="full", float8=True, pp_schedule=schedule), **kw)
    return TrainSetup(**kw)


def test_schedules_order_forwards_and_backwards_as_torch() -> None:
    from gpuprov.sizing import pipeline

    # Schedule1F1B: min(n, pp - stage) warm-up forwards, then 1B1F
    assert pipeline.rank_ops(4, 4, 1, 1) == (("F", 0),) * 3 + (("B", 0), ("F", 0)) + (("B", 0),) * 3
    # Interleaved1F1B, n = pp = 8: rank 0 warms up 8 + 14 -> all 16 forwards; the last rank 8, then F/B in turn
    ops0 = pipeline.rank_ops(8, 8, 2, 0)
    assert ops0[:16] == (("F", 0),) * 8 + (("F", 1),) * 8 and ops0[16:] == (("B", 1),) * 8 + (("B", 0),) * 8
    ops7 = pipeline.rank_ops(8, 8, 2, 7)
    assert ops7[:8] == (("F", 0),) * 8 and ops7[8:10] == (("F", 1), ("B", 1))
    for r in range(8):  # every forward and backward of both local stages, once
        ops = pipeline.rank_ops(8, 8, 2, r)
        assert sorted(ops) == sorted([("F", 0), ("F", 1), ("B", 0), ("B", 1)] * 8)


def test_interleaved_keeps_one_local_stage_of_gradients_whole() -> None:
    """FSDP under PP reduce-scatters a stage at its last backward: with two stages per rank whose backwards
    do not interleave, half the rank's blocks have whole gradients at a time; 1F1B holds all of them. Beside
    them the reduce-scatter stream's pool keeps every held block's sharded gradient (FSDP 8) reserved."""
    one = estimate_memory(L405, _piped("1F1B"))
    two = estimate_memory(L405, _piped("Interleaved1F1B"))
    layer_grad = 4 * L405.layer_params() / 8  # fp32, one TP shard
    assert 16 * layer_grad * (1 + 1 / 8) * 0.99 <= one.breakdown["gradients"] <= 16 * layer_grad * (1 + 1 / 8) * 1.01
    assert two.breakdown["gradients"] <= (8 + 16 / 8 + 0.5) * layer_grad
    assert two.per_gpu_bytes < one.per_gpu_bytes
    assert any("Interleaved1F1B" in a for a in two.assumptions)


def test_last_stage_keeps_every_micro_batch_logits() -> None:
    s = _piped("1F1B", pp_keeps_logits=True)  # torchtitan of Dec 2024: step() kept and merged the outputs
    last = [st for st in parallel.stages(L405, s) if st.head]
    assert last and max(st.logit_chunks for st in last) == 8
    # gpuprov's trainer: the last stage's forward ends in the loss, so no logits wait and none merge
    plain = _piped("1F1B")
    assert all(st.logit_chunks == 0 for st in parallel.stages(L405, plain))

    lay = parallel.layout(s)
    logits = 4 * 8192 * L405.vocab_size / 8 * 2  # bf16, vocabulary-sharded (loss parallel)
    # interleaved, the last pipeline rank is the busiest: several micro-batches' logits are what it sheds
    kept = estimate_memory(L405, _piped("Interleaved1F1B", pp_keeps_logits=True))
    ends_in_loss = estimate_memory(L405, _piped("Interleaved1F1B"))
    assert kept.breakdown["pp_stage_outputs"] - ends_in_loss.breakdown["pp_stage_outputs"] > 5 * logits
    merged = max(parallel.stage_outputs(L405, lay, st, 4 * 8192, 2, merged=True) for st in parallel.stages(L405, s)
                 if st.end and st.logit_chunks)
    assert merged >= 16 * logits  # the kept chunks and their torch.cat as the step returns


def test_float8_all_gather_off_gathers_the_stage_in_bf16() -> None:
    """torchtitan float8.py gathers in float8 only with dp_shard ranks: FSDP 1 x CP 8 gathers bf16 weights,
    and under PP a stage holds them all step: one more byte per gathered linear parameter."""
    on = estimate_memory(L405, _piped("1F1B", cp=8, seq_len=8192 * 8, micro_batch=1))
    off = estimate_memory(L405, _piped("1F1B", cp=8, seq_len=8192 * 8, micro_batch=1, float8_all_gather=False))
    linear = L405.layer_linear_params() / 8  # one TP shard of a block's linears
    extra = off.breakdown["gathered_params"] - on.breakdown["gathered_params"]
    assert extra == pytest.approx(16 * linear, rel=0.02)  # the 16 blocks of the busiest stage, bf16 - float8


def test_interleaved_needs_micro_batches_a_multiple_of_pp() -> None:
    with pytest.raises(GpuprovError, match="multiple of --pp"):
        estimate_memory(L405, _piped("Interleaved1F1B", grad_accumulation_steps=4))
    with pytest.raises(GpuprovError, match="not one of"):
        estimate_memory(L405, _piped("GPipe"))


def test_fsdp_under_pp_keeps_the_stage_gathered_and_its_gradients_unsharded() -> None:
    """torchtitan + torch.distributed.pipelining: no reshard after forward, no reshard or gradient sync after
    each micro-batch's backward: a stage's fp32 gradients stay whole (of its TP shard) and every block of the
    stage stays gathered, where plain FSDP holds 1/dp of the gradients and two gathered blocks."""
    common = dict(gpus=256, tp=8, activation_checkpointing="full", grad_accumulation_steps=8, sharding="fsdp")
    piped = est(pp=4, **common)
    flat = est(pp=1, **common)
    dp = 256 // (8 * 4)
    stage_params = L70.num_layers // 4 * L70.layer_params() / 8  # one stage's blocks, one TP shard
    assert piped.breakdown["gradients"] >= 4 * stage_params  # fp32, unsharded over the dp ranks
    assert piped.breakdown["gradients"] > dp * flat.breakdown["gradients"] / 4 * 0.9
    assert piped.breakdown["gathered_params"] >= 2 * stage_params  # every block of the stage, bf16
    assert piped.breakdown["gathered_params"] > 3 * flat.breakdown["gathered_params"]  # 20 blocks vs 2 (+ root)
    assert any("FSDP under PP" in a for a in piped.assumptions)
    assert not any("FSDP under PP" in a for a in flat.assumptions)


def test_stages_split_as_torchtitan_and_cover_every_layer() -> None:
    from gpuprov.sizing import pipeline

    # torchtitan generate_split_points: first stage num_layers // stages, middle stages one more while it lasts
    assert pipeline.split_layers(126, 8) == (15, 16, 16, 16, 16, 16, 16, 15)
    assert pipeline.split_layers(126, 16) == (7,) + (8,) * 14 + (7,)
    for pp in (1, 2, 3, 7, 80):
        assert sum(pipeline.split_layers(L70.num_layers, pp)) == L70.num_layers
        held = {m.rank: m.held for m in pipeline.moments(L70.num_layers, pp, pp, "1F1B", True)}
        assert sorted(held) == list(range(pp)) and sum(h[0] for h in held.values()) == L70.num_layers
        assert held[0][1] and held[pp - 1][2]  # embedding on the first rank, head on the last


def test_layout_without_parallelism_is_unchanged() -> None:
    plain = est(gpus=16)
    explicit = est(gpus=16, tp=1, cp=1, pp=1)
    assert plain == explicit
    assert not any(k in plain.breakdown for k in parallel.PARALLEL_TERMS)


@pytest.mark.parametrize("kw, message", [
    (dict(gpus=12, tp=8), "does not divide 12 GPUs"),
    (dict(gpus=16, tp=16), "key/value heads"),
    (dict(gpus=16, tp=8, task="lora"), "--task full"),
    (dict(gpus=16, tp=8, sharding="zero2"), "does not combine"),
    (dict(gpus=16, tp=8, sharding="none"), "data-parallel ranks"),
    (dict(gpus=8, cp=8, seq_len=4104), "multiple of 2 x --cp"),
    (dict(gpus=8, tp=8, seq_len=4100), "multiple of --tp"),
    (dict(gpus=160, pp=160), "exceeds the 80 layers"),
    (dict(gpus=16, tp=0), "positive integer"),
])
def test_bad_layouts_are_one_line_errors(kw, message) -> None:
    with pytest.raises(GpuprovError, match=message):
        est(**kw)


def _cli(*args: str):
    from gpuprov.cli import cli

    return CliRunner().invoke(cli, ["estimate", *args], standalone_mode=False, catch_exceptions=True)


def test_estimate_flags_reach_the_json() -> None:
    r = _cli("--model", "70b", "--gpus", "64", "--tp", "8", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["setup"]["tp"] == 8 and d["setup"]["cp"] == 1
    assert any("TP 8" in a for a in d["assumptions"])
    plain = json.loads(_cli("--model", "70b", "--gpus", "64", "--json").output)
    assert d["per_gpu_bytes"] < plain["per_gpu_bytes"]


def test_estimate_pp_schedule_reaches_the_setup() -> None:
    common = ("--model", "405b", "--gpus", "512", "--tp", "8", "--pp", "8", "--grad-accumulation", "8",
              "--micro-batch", "4", "--activation-checkpointing", "full", "--json")
    one = json.loads(_cli(*common).output)
    two = json.loads(_cli(*common, "--pp-schedule", "Interleaved1F1B").output)
    assert one["setup"]["pp_schedule"] == "1F1B" and two["setup"]["pp_schedule"] == "Interleaved1F1B"
    assert two["per_gpu_bytes"] < one["per_gpu_bytes"]
    assert any("Interleaved1F1B" in a for a in two["assumptions"])
    bad = _cli(*common[:-1], "--grad-accumulation", "4", "--pp-schedule", "Interleaved1F1B")
    assert isinstance(bad.exception, GpuprovError) and "multiple of --pp" in str(bad.exception)


def test_estimate_tp_on_one_node_defaults_to_fsdp() -> None:
    d = json.loads(_cli("--model", "70b", "--gpus", "8", "--tp", "8", "--json").output)
    assert d["setup"]["sharding"] == "fsdp"  # what the trainer runs (FSDP2 over the lone dp rank)


def test_estimate_bad_layout_exits_2() -> None:
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "gpuprov", "estimate", "--model", "70b", "--gpus", "12", "--tp", "8"],
                       capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "does not divide" in p.stderr


def _megatron():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "megatron_memory.py"
    spec = importlib.util.spec_from_file_location("megatron_memory", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["megatron_memory"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def test_megatron_benchmark_reimplements_the_published_arithmetic() -> None:
    """Megatron's formula on GPT-3 175B (Korthikanti et al. 2022 Table 3 setup: t=8, p=8, s=2048, b=1)."""
    mm = _megatron()

    a = mm.MegatronArgs(num_layers=96, hidden_size=12288, ffn_hidden_size=4 * 12288, num_attention_heads=96,
                        num_query_groups=96, kv_channels=128, padded_vocab_size=51200, seq_length=2048,
                        micro_batch_size=1, tensor_model_parallel_size=8, pipeline_model_parallel_size=8,
                        data_parallel_size=1, swiglu=False, rmsnorm=False, num_microbatches=64)
    # Table 2 (SP + selective): 34 sbh / t per layer, L layers on the first stage with p in flight
    s, b, h = 2048, 1, 12288
    expected_act = (34 * s * b * h * 96 + 8 * s * b * 8 + s * b * h * 8) / 8
    assert mm.megatron_activation(a) == pytest.approx(expected_act)
    # weights: (12 h^2 + 13 h... ) -- the 2-layer-norm GPT block: 12h^2 + 4h params, /p layers, /t
    block = (2 * h * h * 2 + 2 * h * 4 * h) * 96
    replicated = (2 * h * 2) * 96 + 2 * h
    expected_w = ((block / 8 + h * 51200) / 8 + replicated / 8) * 18
    assert mm.megatron_weight_and_optimizer(a) == pytest.approx(expected_w)


def test_megatron_benchmark_rows_bridge_within_target() -> None:
    mm = _megatron()

    rows = mm.run("70b")
    assert len(rows) == len(mm.ROWS)
    for r in rows:
        assert abs(r["params_delta_pct"]) < 1.0, r  # TP/PP weight split = Megatron's most loaded shard
    assert "PASS" in mm.render("70b", rows)


@pytest.mark.parametrize("pp,n,schedule", [(4, 8, "1F1B"), (8, 32, "1F1B"), (4, 16, "Interleaved1F1B")])
def test_moment_front_equals_the_pairwise_filter(pp, n, schedule) -> None:
    """The kept moments of a rank are those no other dominates (the earliest of equal ones), found in
    sorted order rather than by comparing every pair (a deep accumulation gives a rank hundreds)."""
    from gpuprov.sizing import pipeline

    pipeline.moments.cache_clear()
    front = pipeline._front
    fast = pipeline.moments(126, pp, n, schedule, True)
    try:
        pipeline._front = lambda c: [m for i, m in enumerate(c) if not any(
            pipeline._dominated(m, o) and (j < i or not pipeline._dominated(o, m)) for j, o in enumerate(c) if j != i)]
        pipeline.moments.cache_clear()
        assert pipeline.moments(126, pp, n, schedule, True) == fast
    finally:
        pipeline._front = front
        pipeline.moments.cache_clear()
