"""Step time under TP / CP: per-dimension communication, and the FSDP part seen through the layout."""

from __future__ import annotations

import pytest

from gpuprov.catalog.gpus import get_gpu
from gpuprov.catalog.models import get_model
from gpuprov.sizing.throughput import (
    LayerShape,
    Shape,
    assumptions,
    cp_comm_seconds,
    flops_per_token,
    layout_step_estimate,
    step_estimate,
    tp_comm_seconds,
)

L70 = get_model("llama-3.1-70b")
H100 = get_gpu("h100-80gb")
LAYER = LayerShape(L70.num_layers, L70.hidden_size, L70.q_dim)


def _kw(ac="selective", seq=4096):
    return dict(flops=flops_per_token(L70, seq, "full", L70.params, ac), peak_tflops=H100.bf16_tflops, util=0.4,
                hbm_gbytes_per_s=H100.hbm_gbytes_per_s, intra_gbytes=360.0, inter_gbytes=40.0,
                params=L70.params, trainable=L70.params, num_layers=L70.num_layers, task="full")


def test_tp_collectives_follow_megatron_counts() -> None:
    mp = assumptions().raw["model_parallel"]
    t, tokens, bw = 8, 4096, 360.0
    none = tp_comm_seconds(tokens=tokens, layer=LAYER, tp=t, ac="none", gbytes=bw, latency=0.0)
    calls = mp["tp_allreduces_forward_per_layer"] + mp["tp_allreduces_backward_per_layer"]
    expected = calls * 2 * (t - 1) / t * tokens * L70.hidden_size * 2 / (bw * 1e9) * L70.num_layers
    assert none == pytest.approx(expected)
    full = tp_comm_seconds(tokens=tokens, layer=LAYER, tp=t, ac="full", gbytes=bw, latency=0.0)
    assert full == pytest.approx(none * (calls + mp["tp_allreduces_forward_per_layer"]) / calls)
    assert tp_comm_seconds(tokens=tokens, layer=LAYER, tp=1, ac="none", gbytes=bw, latency=1e-5) == 0.0
    assert tp_comm_seconds(tokens=2 * tokens, layer=LAYER, tp=t, ac="none", gbytes=bw, latency=0.0) == \
        pytest.approx(2 * none)


def test_cp_ring_grows_with_hops_and_vanishes_at_one() -> None:
    two = cp_comm_seconds(tokens=8192, layer=LAYER, tp=1, cp=2, gbytes=360.0, latency=0.0)
    four = cp_comm_seconds(tokens=8192, layer=LAYER, tp=1, cp=4, gbytes=360.0, latency=0.0)
    assert four == pytest.approx(3 * two)  # cp - 1 hops of the same local chunk
    assert cp_comm_seconds(tokens=8192, layer=LAYER, tp=1, cp=1, gbytes=360.0, latency=0.0) == 0.0
    assert cp_comm_seconds(tokens=8192, layer=LAYER, tp=2, cp=2, gbytes=360.0, latency=0.0) == pytest.approx(two / 2)


def test_layout_without_parallelism_is_the_plain_step() -> None:
    shape = Shape(nodes=4, gpus_per_node=8, sharding="fsdp", shard_group=32, micro_batch=2, grad_accum=4,
                  seq_len=4096)
    plain = step_estimate(shape=shape, **_kw())
    same = layout_step_estimate(shape=shape, tp=1, cp=1, layer=LAYER, ac="selective", **_kw())
    assert same == plain


def test_tp_divides_compute_and_keeps_the_token_count() -> None:
    shape = Shape(nodes=4, gpus_per_node=8, sharding="fsdp", shard_group=32, micro_batch=2, grad_accum=4,
                  seq_len=4096)
    flat = step_estimate(shape=shape, **_kw())
    tp = layout_step_estimate(shape=shape, tp=8, cp=1, layer=LAYER, ac="selective", **_kw())
    # 4 data-parallel ranks instead of 32: the same micro-batch split 8 ways
    assert tp.terms["compute_per_micro_batch_s"] == pytest.approx(flat.terms["compute_per_micro_batch_s"] / 8)
    tokens_per_step = 2 * 4096 * 4 * (32 // 8)
    assert tp.tokens_per_s * tp.step_time_s == pytest.approx(tokens_per_step)
    assert tp.mfu == pytest.approx(tp.tokens_per_s * _kw()["flops"].model / (H100.bf16_tflops * 1e12 * 32))
    # TP collectives are on the critical path: the step pays them in full
    assert tp.terms["tp_comm_per_micro_batch_s"] > 0
    assert tp.step_time_s >= tp.compute_time_s + 4 * tp.terms["tp_comm_per_micro_batch_s"]


def test_cp_ring_hides_under_compute_when_it_can() -> None:
    shape = Shape(nodes=1, gpus_per_node=8, sharding="fsdp", shard_group=8, micro_batch=1, grad_accum=1,
                  seq_len=131072)
    st = layout_step_estimate(shape=shape, tp=1, cp=8, layer=LAYER, ac="full", **_kw("full", 131072))
    ring = st.terms["cp_ring_per_micro_batch_s"]
    assert ring > 0
    # at 128K the all-gathers hide behind one SDPA chunk each; the last fp32 dK/dV hop of every layer's
    # backward is waited for after the loop (torch's _templated_ring_attention_backward): exposed always
    exposed = st.terms["cp_exposed_per_micro_batch_s"]
    hop = 2.0 * LAYER.kv_width * 131072 / 8 * 4.0 / (_kw()["intra_gbytes"] * 1e9) + assumptions().lat_intra
    assert exposed == pytest.approx(LAYER.num_layers * hop, rel=1e-6)
    assert 0 < exposed < ring


def test_cp_exposure_follows_torch_ring_attention() -> None:
    from gpuprov.sizing.throughput import cp_exposed_seconds

    kw = dict(tokens=4096.0, layer=LAYER, tp=1, cp=8, gbytes=100.0, latency=0.0, recompute=False)
    # no attention time to hide behind: every transfer is exposed (one all-gather forward, one backward,
    # cp fp32 dK/dV hops)
    kv = 2.0 * LAYER.kv_width * 4096
    bare = cp_exposed_seconds(attn_fwd_s=0.0, attn_bwd_s=0.0, **kw)
    gather, hop = 7 * kv * 2 / 100e9, kv * 4 / 100e9
    assert bare == pytest.approx(LAYER.num_layers * (2 * gather + 8 * hop))
    # full AC runs the forward (and its all-gather) twice
    assert cp_exposed_seconds(attn_fwd_s=0.0, attn_bwd_s=0.0, **{**kw, "recompute": True}) == pytest.approx(
        bare + LAYER.num_layers * gather)
    # long attention hides all but the last hop; CP 1 has no ring
    assert cp_exposed_seconds(attn_fwd_s=10.0, attn_bwd_s=20.0, **kw) == pytest.approx(LAYER.num_layers * hop)
    assert cp_exposed_seconds(attn_fwd_s=0.0, attn_bwd_s=0.0, **{**kw, "cp": 1}) == 0.0


def test_float8_tp_gathers_move_one_byte_and_reduce_scatters_stay_bf16() -> None:
    """torchao's Float8ColwiseParallel / PrepareFloat8ModuleInput gather float8 inputs, its rowwise output
    gradient is cast before the backward all-gather; partial sums reduce-scatter in bf16: 3/4 of the bytes."""
    kw = dict(tokens=8192.0, layer=LAYER, tp=8, ac="full", gbytes=360.0, latency=0.0)
    bf16 = tp_comm_seconds(**kw)
    f8 = tp_comm_seconds(**kw, float8=True)
    assert f8 == pytest.approx(0.75 * bf16)
    shape = Shape(nodes=4, gpus_per_node=8, sharding="fsdp", shard_group=32, micro_batch=2, grad_accum=1, seq_len=8192)
    plain = layout_step_estimate(shape=shape, tp=8, cp=1, layer=LAYER, ac="full", **_kw("full", 8192))
    fast = layout_step_estimate(shape=shape, tp=8, cp=1, layer=LAYER, ac="full", float8_gain=1.5, **_kw("full", 8192))
    lat = assumptions().lat_intra
    for est, f8 in ((plain, False), (fast, True)):  # a float8 gain means float8 linears: their TP gathers are float8
        assert est.terms["tp_comm_per_micro_batch_s"] == pytest.approx(tp_comm_seconds(
            tokens=2 * 8192.0, layer=LAYER, tp=8, ac="full", gbytes=360.0, latency=lat, float8=f8))


def test_cp_ring_merge_is_memory_bound_work_on_the_compute_stream() -> None:
    """torch's ring attention merges each round's output in fp32 and accumulates dq/dK/dV in fp32: HBM bytes
    that grow with the rounds, paid in full by the step, and twice for the forward under full AC."""
    from gpuprov.sizing.throughput import cp_merge_seconds

    layer = LayerShape(32, 4096, 4096)  # Llama 3.1 8B with K/V repeated to the query heads
    kw = dict(tokens=32768.0, layer=layer, tp=1, hbm_gbytes_per_s=2400.0)
    assert cp_merge_seconds(cp=1, recompute=True, **kw) == 0.0
    two, eight = cp_merge_seconds(cp=2, recompute=False, **kw), cp_merge_seconds(cp=8, recompute=False, **kw)
    # per round: the forward merge (out cast + three fp32 passes + K/V concat) and the backward fp32
    # accumulation (dq add, dK/dV partial add + cat, dK/dV concat for the next rank, K/V concat)
    e = 32768 * 4096
    per_round = e * (6 + 32 + 2 * 8) + e * (10 + 2 * (8 + 13 + 8))
    assert eight - two == pytest.approx(6 * 32 * per_round / 2400e9)
    # full AC adds the forward's bytes once more; twice the bandwidth halves it; TP splits the heads
    full = cp_merge_seconds(cp=8, recompute=True, **kw)
    assert eight < full < 2 * eight
    assert cp_merge_seconds(cp=8, recompute=False, **{**kw, "hbm_gbytes_per_s": 4800.0}) == pytest.approx(eight / 2)
    assert cp_merge_seconds(cp=8, recompute=False, **{**kw, "tp": 2}) == pytest.approx(eight / 2)


def test_cp_merge_lengthens_the_step() -> None:
    shape = Shape(nodes=1, gpus_per_node=8, sharding="fsdp", shard_group=8, micro_batch=1, grad_accum=2,
                  seq_len=131072)
    st = layout_step_estimate(shape=shape, tp=1, cp=8, layer=LAYER, ac="full", **_kw("full", 131072))
    merge = st.terms["cp_merge_per_micro_batch_s"]
    assert merge > 0
    assert st.step_time_s == pytest.approx(
        st.compute_time_s + st.exposed_comm_s + st.optimizer_time_s + st.terms["pipeline_bubble_s"])
    # memory-bound work on the compute stream, not communication
    assert st.exposed_comm_s == pytest.approx(2 * st.terms["cp_exposed_per_micro_batch_s"] + st.terms["exposed_sync_s"]
                                              + 2 * st.terms["exposed_per_micro_batch_s"] + st.terms["tail_s"])
    assert st.compute_time_s == pytest.approx(2 * (st.terms["compute_per_micro_batch_s"] + merge))


def test_float8_gathers_under_tp_and_pp_shrink_with_the_rank_shard() -> None:
    """Each rank all-gathers its TP shard of its stage: the float8 linears' bytes saved are that shard's, so FSDP's
    traffic stays positive and is a fixed share of the bf16 layout's, whatever tp x pp is."""
    shape = Shape(nodes=4, gpus_per_node=8, sharding="fsdp", shard_group=32, micro_batch=2, grad_accum=1, seq_len=8192)
    f8_params = L70.num_layers * L70.layer_linear_params()
    ratios = []
    for tp in (1, 2, 8):
        plain = layout_step_estimate(shape=shape, tp=tp, cp=1, layer=LAYER, ac="full", **_kw("full", 8192))
        f8 = layout_step_estimate(shape=shape, tp=tp, cp=1, layer=LAYER, ac="full", float8_gain=1.5,
                                  float8_params=f8_params, **_kw("full", 8192))
        assert 0.0 < f8.terms["comm_per_micro_batch_s"] < plain.terms["comm_per_micro_batch_s"]
        ratios.append(f8.comm_bytes_per_gpu / plain.comm_bytes_per_gpu)
    assert ratios[1] == pytest.approx(ratios[0], rel=0.02) and ratios[2] == pytest.approx(ratios[0], rel=0.02)


def test_async_tp_leaves_the_summed_backward_reduce_scatters_exposed() -> None:
    """Inductor's micro-pipeline TP fuses a reduce-scatter only with the one matmul producing its input; the backward
    reduce-scatters of the attention and MLP inputs' gradients (sums of the q/k/v and w1/w3 input gradients) stay
    plain collectives, so however long the matmuls, async TP leaves that share of the TP traffic on the critical
    path."""
    from gpuprov.sizing.async_tp import async_tp_exposed_seconds

    mp = assumptions().raw["model_parallel"]
    calls = mp["tp_allreduces_forward_per_layer"] * 2 + mp["tp_allreduces_backward_per_layer"]  # with recompute
    unfused = mp["async_tp_unfused_reduce_scatters_per_layer"]
    tp_s = 1.0
    long_gemms = async_tp_exposed_seconds(tp_s, 1e6, tp=8, ac="full")
    # each call is an all-gather plus a reduce-scatter of the same bf16 bytes: `unfused` halves of calls stay
    assert long_gemms == pytest.approx(unfused / (2 * calls) + (1 - unfused / (2 * calls)) / 16)
    # float8 gathers move half the bytes; the unfused reduce-scatters stay bf16, so their share of the traffic grows
    assert async_tp_exposed_seconds(tp_s, 1e6, tp=8, ac="full", float8=True) > long_gemms
    # matmuls shorter than the fused collectives leave the rest exposed too; no TP, nothing
    assert async_tp_exposed_seconds(tp_s, 0.1, tp=8, ac="full") > long_gemms
    assert async_tp_exposed_seconds(tp_s, 1e6, tp=1, ac="full") == 0.0
    assert 0.0 < long_gemms < tp_s


def test_async_tp_pays_its_local_reductions_on_the_compute_stream() -> None:
    """torch's fused matmul-reduce-scatter stacks every rank's partial products (tokens x hidden) and sums its own
    rows in a separate kernel: HBM traffic on the compute stream that grows with the tokens and recompute, and that
    a vanilla (NCCL) TP step does not have."""
    from gpuprov.sizing.async_tp import async_tp_reduce_seconds

    kw = dict(tokens=8192.0, layer=LAYER, tp=8, hbm_gbytes_per_s=3350.0)
    plain = async_tp_reduce_seconds(ac="none", **kw)
    assert plain > 0.0
    assert async_tp_reduce_seconds(ac="full", **kw) == pytest.approx(2 * plain)  # the recomputed forward again
    assert async_tp_reduce_seconds(ac="none", **{**kw, "tokens": 16384.0}) == pytest.approx(2 * plain)
    assert async_tp_reduce_seconds(ac="none", **{**kw, "hbm_gbytes_per_s": 1675.0}) == pytest.approx(2 * plain)
    assert async_tp_reduce_seconds(ac="none", **{**kw, "tp": 1}) == 0.0
    shape = Shape(nodes=4, gpus_per_node=8, sharding="fsdp", shard_group=32, micro_batch=2, grad_accum=1, seq_len=8192)
    vanilla = layout_step_estimate(shape=shape, tp=8, cp=1, layer=LAYER, ac="full", **_kw("full", 8192))
    assert vanilla.terms["async_tp_reduce_per_micro_batch_s"] == 0.0
