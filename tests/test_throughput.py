"""Throughput model: FLOPs per token, compute vs communication, what comm-bound configs pay."""

from __future__ import annotations

import pytest

from gpuprov.catalog.gpus import get_gpu, list_gpus
from gpuprov.catalog.models import get_model
from gpuprov.sizing.throughput import (
    Shape, assumptions, flops_per_token, gpu_class, inter_node_gbytes, intra_node_gbytes, step_estimate,
    utilisation,
)


@pytest.fixture(scope="module")
def arch8b():
    return get_model("llama-3.1-8b")


def _step(arch, gpu, shape, *, fabric="efa", gbps=400.0, ac="none", task="full", trainable=None):
    trainable = arch.params if trainable is None else trainable
    fl = flops_per_token(arch, shape.seq_len, task, trainable, ac)
    util, _ = utilisation(gpu)
    intra, _ = intra_node_gbytes(gpu)
    return step_estimate(shape=shape, flops=fl, peak_tflops=gpu.bf16_tflops, util=util,
                         hbm_gbytes_per_s=gpu.hbm_gbytes_per_s, intra_gbytes=intra,
                         inter_gbytes=inter_node_gbytes(fabric, gbps), params=arch.params, trainable=trainable,
                         num_layers=arch.num_layers, task=task)


def test_flops_per_token_is_6n_plus_attention(arch8b):
    s = 4096
    fl = flops_per_token(arch8b, s, "full", arch8b.params, "none")
    n = arch8b.params - arch8b.embedding_params  # untied: the input embedding is a lookup
    attn = 12 * arch8b.num_layers * s * arch8b.num_attention_heads * arch8b.head_dim
    assert fl.matmul_params == n
    assert fl.model == pytest.approx(6 * n + attn)
    assert fl.executed == fl.model
    # 8B at 4K: attention adds ~13% on top of 6N (PaLM appendix B arithmetic)
    assert 0.10 < attn / (6 * n) < 0.16


def test_recompute_costs_flops_but_not_model_flops(arch8b):
    none = flops_per_token(arch8b, 4096, "full", arch8b.params, "none")
    sel = flops_per_token(arch8b, 4096, "full", arch8b.params, "selective")
    full = flops_per_token(arch8b, 4096, "full", arch8b.params, "full")
    assert none.model == sel.model == full.model
    assert none.executed < sel.executed < full.executed
    # full AC re-runs the forward: executed ~ 8N/6N of the model FLOPs
    assert full.executed / full.model == pytest.approx(4 / 3, rel=0.02)


def test_selective_ac_recomputes_the_matmuls_the_trainers_policy_drops(arch8b):
    """Op-level SAC (templates/launch/train_model.py selective_ac_context) keeps SDPA and the odd-numbered
    matmuls of q, k, v, o, gate, up, down: it re-runs k, o and up, whatever the sequence length."""
    from gpuprov.sizing.throughput import attention_executed, sac_recompute_params

    h, q, kv, inter = arch8b.hidden_size, arch8b.q_dim, arch8b.kv_dim, arch8b.intermediate_size
    assert sac_recompute_params(arch8b) == h * kv + q * h + h * inter
    short, long = (flops_per_token(arch8b, s, "full", arch8b.params, "selective") for s in (2048, 65536))
    assert short.recompute == long.recompute == 2 * arch8b.num_layers * sac_recompute_params(arch8b)
    assert short.attention_recompute == long.attention_recompute == 0.0  # SDPA's output is saved
    assert attention_executed(long) == long.attention
    full = flops_per_token(arch8b, 2048, "full", arch8b.params, "full")
    assert attention_executed(full) == pytest.approx(full.attention * 4 / 3)  # the forward's attention again
    # the same under LoRA: its two adapter matmuls per linear keep the base matmuls' parity
    lora = flops_per_token(arch8b, 2048, "lora", arch8b.trainable_params("lora", 16, "all-linear"), "selective")
    assert lora.recompute == short.recompute


def test_lora_flops_skip_weight_gradients(arch8b):
    lora_trainable = arch8b.trainable_params("lora", 16, "all-linear")
    lora = flops_per_token(arch8b, 4096, "lora", lora_trainable, "none")
    full = flops_per_token(arch8b, 4096, "full", arch8b.params, "none")
    assert lora.model < full.model
    assert lora.model == pytest.approx(4 * lora.matmul_params + 6 * lora_trainable + lora.attention)


def test_single_gpu_has_no_communication(arch8b):
    gpu = get_gpu("h200-141gb")
    st = _step(arch8b, gpu, Shape(nodes=1, gpus_per_node=1, sharding="none", shard_group=1, micro_batch=1,
                                  grad_accum=4, seq_len=4096))
    assert st.comm_time_s == 0 and st.exposed_comm_s == 0
    assert st.step_time_s == pytest.approx(st.compute_time_s + st.optimizer_time_s)
    assert st.bound == "compute"
    # MFU = assumed utilisation when nothing but compute runs (optimizer is a small extra)
    assert st.mfu == pytest.approx(utilisation(gpu)[0], rel=0.05)


def test_ddp_all_reduce_volume(arch8b):
    gpu = get_gpu("h100-80gb")
    n = 16
    st = _step(arch8b, gpu, Shape(nodes=2, gpus_per_node=8, sharding="ddp", shard_group=1, micro_batch=1,
                                  grad_accum=8, seq_len=4096))
    expected = 2 * (n - 1) / n * arch8b.params * assumptions().grad_reduce_bytes
    assert st.comm_bytes_per_gpu == pytest.approx(expected)


def test_slow_fabric_makes_fsdp_communication_bound_and_charges_it(arch8b):
    gpu = get_gpu("h100-80gb")
    shape = Shape(nodes=4, gpus_per_node=8, sharding="fsdp", shard_group=32, micro_batch=1, grad_accum=4,
                  seq_len=4096)
    fast = _step(arch8b, gpu, shape, fabric="efa", gbps=400)
    slow = _step(arch8b, gpu, shape, fabric="ethernet", gbps=12.5)
    assert fast.compute_time_s == pytest.approx(slow.compute_time_s)
    assert slow.exposed_comm_s > slow.compute_time_s  # the wire dominates
    assert slow.bound == "communication"
    assert slow.step_time_s > 2 * fast.step_time_s
    assert slow.mfu < fast.mfu


def test_hsdp_keeps_gathers_on_nvlink(arch8b):
    gpu = get_gpu("h100-80gb")
    common = dict(nodes=4, gpus_per_node=8, micro_batch=1, grad_accum=4, seq_len=4096)
    fsdp = _step(arch8b, gpu, Shape(sharding="fsdp", shard_group=32, **common), fabric="ethernet", gbps=25)
    hsdp = _step(arch8b, gpu, Shape(sharding="hsdp", shard_group=8, **common), fabric="ethernet", gbps=25)
    assert hsdp.step_time_s < fsdp.step_time_s


def test_intra_node_links():
    nvl, name = intra_node_gbytes(get_gpu("h100-80gb"))
    assert name == "NVLink" and nvl == pytest.approx(450 * assumptions().link_eff["nvlink"])
    pcie, name = intra_node_gbytes(get_gpu("l40s-48gb"))
    assert "PCIe Gen4" in name and pcie < nvl
    nop2p, name = intra_node_gbytes(get_gpu("rtx-4090-24gb"))
    assert "no P2P" in name and nop2p < pcie


def test_every_gpu_has_a_sourced_utilisation():
    a = assumptions()
    for gpu in list_gpus():
        cls = gpu_class(gpu)
        value, source = a.utilisation[cls]
        assert 0.1 < value < 0.7 and len(source) > 20, (gpu.slug, cls)


def test_power_limit_and_compile_set_the_utilisation():
    """The hopper figure was measured compiled at 500 W: a 700 W part sustains (700/500)^(1/3) of it,
    an eager run the measured eager/compiled ratio."""
    import dataclasses

    h100 = get_gpu("h100-80gb")
    capped = dataclasses.replace(h100, tdp_w=500)
    full, _ = utilisation(h100)
    at_500, _ = utilisation(capped)
    assert at_500 == pytest.approx(assumptions().utilisation["hopper"][0])
    assert full / at_500 == pytest.approx((700 / 500) ** (1 / 3), rel=1e-3)
    eager, _ = utilisation(h100, compiled=False)
    assert eager == pytest.approx(full * assumptions().raw["compile"]["eager_factor"])


def test_rings_across_nodes_use_the_nodes_nics(arch8b):
    """A ring spanning nodes runs on every NIC of the node (one NCCL channel per NIC): 16 nodes of
    8 x 400 Gb/s are compute-bound for 8B FSDP, where one NIC's share would make them wait on the fabric."""
    gpu = get_gpu("h100-80gb")
    shape = Shape(nodes=16, gpus_per_node=8, sharding="fsdp", shard_group=128, micro_batch=1, grad_accum=1,
                  seq_len=4096)
    st = _step(arch8b, gpu, shape, fabric="infiniband", gbps=400, ac="selective")
    bw = 400 / 8 * assumptions().link_eff["infiniband"] * 8
    assert st.terms["comm_per_micro_batch_s"] < 1.2 * (127 / 128) * (2 * 2 + 4) * arch8b.params / (bw * 1e9) + 0.1
    assert st.bound == "compute"


def test_float8_speeds_up_linears_not_attention(arch8b):
    from gpuprov.sizing.throughput import compute_seconds, float8_linear_gain

    gain = float8_linear_gain(arch8b, 1.28)
    assert gain > 1.28  # the whole-step gain at 8K hides the bf16 attention share
    short = flops_per_token(arch8b, 8192, "full", arch8b.params, "selective")
    long = flops_per_token(arch8b, 131072, "full", arch8b.params, "full")
    at_8k = compute_seconds(1, short, 989.0, 0.4) / compute_seconds(1, short, 989.0, 0.4, gain)
    at_128k = compute_seconds(1, long, 989.0, 0.4) / compute_seconds(1, long, 989.0, 0.4, gain)
    assert at_8k == pytest.approx(1.28, rel=1e-6)
    assert 1.0 < at_128k < at_8k


def test_pipeline_bubble_follows_the_schedule():
    from gpuprov.sizing.throughput import Pipeline

    assert Pipeline(stages=1, micro_batches=8).bubble() == 0.0
    assert Pipeline(stages=8, micro_batches=8).bubble() == pytest.approx(7 / 8)
    assert Pipeline(stages=8, micro_batches=8, stages_per_rank=2).bubble() == pytest.approx(7 / 16)


def test_precision_and_offload_cost_time(arch8b):
    gpu = get_gpu("h100-80gb")
    shape = Shape(nodes=1, gpus_per_node=8, sharding="fsdp", shard_group=8, micro_batch=1, grad_accum=4,
                  seq_len=4096)
    fl = flops_per_token(arch8b, 4096, "full", arch8b.params, "none")
    util, _ = utilisation(gpu)
    intra, _ = intra_node_gbytes(gpu)
    common = dict(shape=shape, flops=fl, peak_tflops=gpu.bf16_tflops, util=util,
                  hbm_gbytes_per_s=gpu.hbm_gbytes_per_s, intra_gbytes=intra, inter_gbytes=intra,
                  params=arch8b.params, trainable=arch8b.params, num_layers=arch8b.num_layers, task="full",
                  pcie_gen=5)
    base = step_estimate(**common)
    fp32 = step_estimate(**common, precision="fp32")
    assert fp32.compute_time_s == pytest.approx(2 * base.compute_time_s)  # TF32 = half the BF16 peak
    assert fp32.comm_bytes_per_gpu > base.comm_bytes_per_gpu
    off = step_estimate(**common, offload="optimizer")
    assert off.optimizer_time_s > 10 * base.optimizer_time_s
    full = step_estimate(**common, offload="full")
    assert full.comm_time_s > off.comm_time_s


def test_async_tp_hides_tp_collectives_under_the_matmuls():
    from gpuprov.sizing.throughput import LayerShape, layout_step_estimate

    arch = get_model("llama-3.1-70b")
    gpu = get_gpu("h100-80gb")
    shape = Shape(nodes=32, gpus_per_node=8, sharding="fsdp", shard_group=256, micro_batch=16, grad_accum=1,
                  seq_len=8192)
    kw = dict(shape=shape, tp=8, cp=1, layer=LayerShape(arch.num_layers, arch.hidden_size, arch.q_dim), ac="full",
              flops=flops_per_token(arch, 8192, "full", arch.params, "full"), peak_tflops=gpu.bf16_tflops,
              util=utilisation(gpu)[0], hbm_gbytes_per_s=gpu.hbm_gbytes_per_s,
              intra_gbytes=intra_node_gbytes(gpu)[0], inter_gbytes=inter_node_gbytes("infiniband", 400),
              params=arch.params, trainable=arch.params, num_layers=arch.num_layers, task="full")
    plain = layout_step_estimate(**kw)
    overlapped = layout_step_estimate(async_tp=True, **kw)
    assert plain.terms["tp_exposed_per_micro_batch_s"] == plain.terms["tp_comm_per_micro_batch_s"] > 0
    assert overlapped.terms["tp_exposed_per_micro_batch_s"] < plain.terms["tp_exposed_per_micro_batch_s"]
    assert overlapped.step_time_s < plain.step_time_s


def test_one_stretch_of_compute_hides_one_transfer_at_a_time() -> None:
    """The step's gradient sync hides only in what the last micro-batch's own collectives left of its
    compute, so a communication-bound step never gets faster from recomputation."""
    arch = get_model("llama-3.1-70b")
    gpu = get_gpu("h100-80gb")
    shape = Shape(nodes=4, gpus_per_node=8, sharding="hsdp", shard_group=16, micro_batch=1, grad_accum=1, seq_len=2048)
    s = _step(arch, gpu, shape, fabric="ethernet", gbps=50.0, ac="selective")
    t = s.terms
    left = max(0.0, assumptions().overlap * t["compute_per_micro_batch_s"] - t["comm_per_micro_batch_s"])
    assert t["exposed_sync_s"] == pytest.approx(max(0.0, t["sync_per_step_s"] - min(
        left, assumptions().overlap * t["compute_per_micro_batch_s"] * 2 / 3)))
    full = _step(arch, gpu, shape, fabric="ethernet", gbps=50.0, ac="full")
    assert full.step_time_s >= s.step_time_s  # more recompute never shortens a step
