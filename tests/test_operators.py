"""The per-operation step model (gpuprov/sizing/operators.py): how each term moves with the setup."""

from __future__ import annotations

import dataclasses

import pytest

from gpuprov.catalog import load_data
from gpuprov.catalog.gpus import get_gpu
from gpuprov.catalog.models import get_model
from gpuprov.planner import make_plan
from gpuprov.sizing import operators
from gpuprov.sizing.step_parts import STEP_TERMS, step_breakdown
from gpuprov.sizing.throughput import (
    LayerShape, Shape, attention_executed, flops_per_token, inter_node_gbytes, intra_node_gbytes, layout_step_estimate,
)
from gpuprov.spec import TrainingSpec

H100 = get_gpu("h100-80gb")
ARCH = get_model("llama-3.1-8b")


def _step(*, seq=8192, nodes=1, gbps=400.0, fabric="infiniband", compiled=True, ac="selective", gpu=H100, mb=1,
          tp=1, arch=ARCH, mask=False):
    shape = Shape(nodes=nodes, gpus_per_node=8, sharding="fsdp", shard_group=nodes * 8, micro_batch=mb, grad_accum=1,
                  seq_len=seq)
    ops = operators.op_model(arch, gpu, ac=ac, compiled=compiled, document_mask=mask)
    return layout_step_estimate(
        shape=shape, tp=tp, cp=1, layer=LayerShape(arch.num_layers, arch.hidden_size, arch.q_dim), ac=ac,
        flops=flops_per_token(arch, seq, "full", arch.params, ac), peak_tflops=gpu.bf16_tflops, util=0.4,
        hbm_gbytes_per_s=gpu.hbm_gbytes_per_s, intra_gbytes=intra_node_gbytes(gpu)[0],
        inter_gbytes=inter_node_gbytes(fabric, gbps), params=arch.params, trainable=arch.params,
        num_layers=arch.num_layers, task="full", pcie_gen=gpu.pcie_gen, ops=ops)


def _share(est, term):
    parts = step_breakdown(est)
    return parts[term] / sum(parts.values())


def test_the_terms_sum_to_the_step():
    est = _step()
    parts = step_breakdown(est)
    assert tuple(parts) == STEP_TERMS
    assert sum(parts.values()) == pytest.approx(est.step_time_s)
    assert all(v >= 0 for v in parts.values()) and parts["gemm"] > parts["attention"] > 0


def test_longer_sequences_raise_the_attention_share():
    shares = [_share(_step(seq=s), "attention") for s in (2048, 8192, 32768)]
    assert shares[0] < shares[1] < shares[2]


def test_more_nodes_on_a_slow_fabric_expose_more_communication():
    slow = [step_breakdown(_step(nodes=n, gbps=25.0, fabric="ethernet"))["exposed_comm"] for n in (2, 8)]
    fast = step_breakdown(_step(nodes=8, gbps=400.0))["exposed_comm"]
    assert slow[1] > slow[0] > 0
    assert fast < slow[1]


def test_eager_moves_more_bytes_and_launches_more_kernels_than_compiled():
    eager, comp = step_breakdown(_step(compiled=False)), step_breakdown(_step(compiled=True))
    assert eager["memory_bound"] > comp["memory_bound"] and eager["launch"] > comp["launch"]
    assert eager["gemm"] == pytest.approx(comp["gemm"]) and eager["attention"] == pytest.approx(comp["attention"])


def test_full_recompute_costs_more_gemm_and_attention_than_selective():
    full, sel, none = (step_breakdown(_step(ac=a)) for a in ("full", "selective", "none"))
    assert full["gemm"] > sel["gemm"] > none["gemm"]
    assert full["attention"] > sel["attention"] == pytest.approx(none["attention"])


def test_small_and_skinny_gemms_run_far_below_the_ceiling():
    g = operators.gpu_ops(H100)
    big = 2 * 16384 * 4096 * 4096 / operators.gemm_seconds(16384, 4096, 4096, g)
    skinny = 2 * 16384 * 16 * 4096 / operators.gemm_seconds(16384, 16, 4096, g)  # a LoRA-rank-wide output
    small = 2 * 256 * 256 * 256 / operators.gemm_seconds(256, 256, 256, g)  # 2 tiles on 132 SMs
    assert big == pytest.approx(g.gemm_flops, rel=0.05)
    assert skinny < 0.2 * g.gemm_flops and small < 0.05 * g.gemm_flops


def test_attention_throughput_follows_the_published_curve():
    g = operators.gpu_ops(H100)
    curve = load_data("operators.yaml")["attention"]["fwd_bwd_causal_tflops"]["hopper"]
    assert operators.attention_flops_per_s(8192, g) == pytest.approx(dict(curve)[8192] * 1e12)
    assert operators.attention_flops_per_s(1024, g) < operators.attention_flops_per_s(16384, g)
    assert operators.attention_flops_per_s(262144, g) == pytest.approx(curve[-1][1] * 1e12)


def test_a_power_cap_slows_the_compute_bound_terms_not_the_memory_bound():
    capped = dataclasses.replace(H100, tdp_w=500)
    a, b = step_breakdown(_step()), step_breakdown(_step(gpu=capped))
    assert b["gemm"] > a["gemm"] and b["attention"] > a["attention"]
    assert b["memory_bound"] == pytest.approx(a["memory_bound"])


def test_tensor_parallel_splits_each_gpus_gemms():
    one, two = step_breakdown(_step(tp=1)), step_breakdown(_step(tp=2))
    # per GPU half the GEMM work (the same micro-batch on two GPUs), not less than half the time
    assert 0.45 * one["gemm"] < two["gemm"] < 0.6 * one["gemm"]


def test_the_gemm_scale_moves_only_the_gemm_term():
    a = operators.op_model(ARCH, H100, ac="selective").terms(micro_batch=1, seq_len=8192)
    b = operators.op_model(ARCH, H100, ac="selective", gemm_scale=0.5).terms(micro_batch=1, seq_len=8192)
    assert b["gemm_s"] == pytest.approx(2 * a["gemm_s"], rel=0.01)
    assert (b["attention_s"], b["memory_bound_s"], b["launch_s"]) == (a["attention_s"], a["memory_bound_s"],
                                                                       a["launch_s"])


def test_every_constant_has_a_source():
    d = load_data("operators.yaml")
    for section in ("gemm", "attention", "memory_bound", "launch"):
        text = " ".join(str(v) for k, v in d[section].items() if "source" in k)
        assert "date 2026" in text, section


def test_the_plan_ranks_and_reports_with_the_operation_model():
    plan = make_plan(TrainingSpec(model="llama-3.1-8b", tokens=10**9, cloud="aws", gpus=["h100-80gb"]))
    t = plan.throughput
    assert set(t.step_terms_s) == set(STEP_TERMS)
    assert sum(t.step_terms_s.values()) == pytest.approx(t.step_time_s, rel=1e-4)
    longer = make_plan(TrainingSpec(model="llama-3.1-8b", tokens=10**9, cloud="aws", gpus=["h100-80gb"],
                                    seq_len=32768))
    share = [p.throughput.step_terms_s["attention"] / p.throughput.step_time_s for p in (plan, longer)]
    assert share[1] > share[0]


def test_the_gpu_waits_for_the_host_when_kernels_are_shorter_than_their_launches():
    """Each kernel costs the host a launch (catalog launch.host_seconds_per_kernel); the host runs ahead of long
    kernels, so only a micro-batch whose work is shorter than its launches is paced by the host."""
    c = operators.constants()["launch"]
    small = get_model("llama-3.2-1b")
    host_s, kernel_s = float(c["host_seconds_per_kernel"]), float(c["seconds_per_kernel"])
    for compiled, mode in ((False, "eager"), (True, "compiled")):
        kernels = small.num_layers * float(c["kernels_per_layer"][mode])
        tiny = operators.op_model(small, H100, ac="none", compiled=compiled).terms(micro_batch=1, seq_len=16)
        assert sum(tiny.values()) == pytest.approx(kernels * host_s)  # host-bound: the step is the launches
        big = operators.op_model(small, H100, ac="none", compiled=compiled).terms(micro_batch=8, seq_len=8192)
        assert big["launch_s"] == pytest.approx(kernels * kernel_s)  # the host ran ahead: launches hide
    eager = operators.op_model(small, H100, ac="none", compiled=False).terms(micro_batch=1, seq_len=16)
    comp = operators.op_model(small, H100, ac="none", compiled=True).terms(micro_batch=1, seq_len=16)
    assert sum(eager.values()) > sum(comp.values())  # compile leaves fewer kernels to launch


def test_a_dense_document_mask_computes_every_score_tile():
    """SDPA given a dense mask runs the memory-efficient kernel, which skips no tile: twice the causal pairs of every
    full-attention layer; sliding-window layers already compute their whole window; nothing else moves."""
    causal, masked = (operators.op_model(ARCH, H100, ac="selective", document_mask=m) for m in (False, True))
    a, b = (ops.terms(micro_batch=1, seq_len=4096) for ops in (causal, masked))
    assert b["attention_s"] == pytest.approx(2 * a["attention_s"], rel=1e-12)
    assert {k: v for k, v in a.items() if k != "attention_s"} == {k: v for k, v in b.items() if k != "attention_s"}
    window = dataclasses.replace(causal.shape, sliding_window=1024, sliding_layers=causal.shape.layers)
    w_causal, w_masked = (dataclasses.replace(ops, shape=window) for ops in (causal, masked))
    assert w_masked.terms(micro_batch=1, seq_len=4096)["attention_s"] == \
        pytest.approx(w_causal.terms(micro_batch=1, seq_len=4096)["attention_s"], rel=1e-12)


def test_the_utilisation_counts_the_attention_work_a_masked_kernel_executes():
    """The plan's "N% of peak on the work it executes" divides the executed FLOPs by the compute time: under a dense
    mask the kernel executes the whole square, so that work counts twice the causal attention."""
    seq = 8192
    fl = flops_per_token(ARCH, seq, "full", ARCH.params, "selective")
    for mask, work in ((False, fl.executed), (True, fl.executed + attention_executed(fl))):
        est = _step(seq=seq, mask=mask)
        seconds = est.terms["compute_per_micro_batch_s"]
        assert est.utilisation == pytest.approx(seq * work / (H100.bf16_tflops * 1e12 * seconds), rel=1e-9)
    masked = operators.op_model(ARCH, H100, ac="selective", document_mask=True)
    half = dataclasses.replace(masked.shape, sliding_window=1024, sliding_layers=masked.shape.layers // 2)
    windowed = dataclasses.replace(masked, shape=half)
    assert windowed.attention_work_factor(4096) == pytest.approx(1.5)  # only the full layers double
    assert windowed.attention_work_factor(1024) == 2.0  # a window as long as the sequence is the whole square
    assert operators.op_model(ARCH, H100, ac="selective").attention_work_factor(4096) == 1.0


@pytest.mark.parametrize("model, masked", [("llama-3.1-8b", True), ("gemma-2-9b", False)])
def test_the_plan_times_the_attention_kernel_its_trainer_runs(model, masked):
    """The default trainer hands SDPA a per-document mask (every tile timed); flash_attention_2 (Gemma 2) takes
    per-document positions and skips masked tiles (timed causal): the plan's attention term says which."""
    plan = make_plan(TrainingSpec(model=model, tokens=10**9, cloud="aws", gpus=["h100-80gb"], pp=1, cp=1))
    c, arch = plan.cluster, get_model(model)
    per_micro_batch = {
        m: operators.op_model(arch, H100, ac=c.activation_checkpointing, compiled=plan.stack.compile, task="full",
                              document_mask=m).terms(micro_batch=c.micro_batch, seq_len=c.seq_len, tp=c.tp)["attention_s"]
        for m in (False, True)}
    assert plan.stack.attention == ("sdpa" if masked else "flash_attention_2")
    timed = plan.throughput.step_terms_s["attention"]  # rounded to the microsecond
    assert timed == pytest.approx(per_micro_batch[masked] * c.grad_accum, rel=1e-4)
    assert timed != pytest.approx(per_micro_batch[not masked] * c.grad_accum, rel=0.2)


B200 = get_gpu("b200-180gb")


def _published(backend: str, seq: int) -> float:
    """fwd + bwd TFLOP/s of one catalogued B200 measurement, combined as FlashAttention counts the work."""
    row = next(r for r in load_data("operators.yaml")["attention"]["fwd_bwd_by_backend"][backend]["blackwell"]
               if r[0] == seq)
    return 3.5 / (1 / row[1] + 2.5 / row[2])


@pytest.mark.parametrize("backend", [None, "flash", "cudnn"])
def test_blackwell_attention_is_timed_at_the_kernel_measured_on_it(backend):
    """B200 attention runs at the B200 measurement of the kernel the run picks (the trainer's torch: flash first),
    not Hopper's scaled by the dense peak; at its TDP no power scaling applies."""
    ops = operators.gpu_ops(B200, sdpa_backend=backend)
    for seq in (2048, 8192, 32768):
        assert operators.attention_flops_per_s(seq, ops) == pytest.approx(_published(backend or "flash", seq) * 1e12)
    hopper = operators.attention_flops_per_s(8192, operators.gpu_ops(H100))
    if backend == "cudnn":
        assert operators.attention_flops_per_s(8192, ops) > 3 * hopper
    else:  # torch's flash kernel gains little from Hopper to Blackwell (mma.sync, not the new tensor cores)
        assert operators.attention_flops_per_s(8192, ops) < 1.1 * hopper


def test_a_backend_without_a_measurement_on_the_gpu_is_refused_not_guessed():
    with pytest.raises(ValueError, match="cudnn"):
        operators.gpu_ops(H100, sdpa_backend="cudnn")
    with pytest.raises(ValueError, match="unknown SDPA backend"):
        operators.gpu_ops(B200, sdpa_backend="triton")


def test_a_plan_on_b200_times_attention_at_the_trainers_kernel():
    plan = make_plan(TrainingSpec(model="llama-3.1-8b", tokens=10**9, cloud="gcp", gpus=["b200-180gb"], pp=1, cp=1,
                                  objective="time"))
    c = plan.cluster
    ops = {b: operators.op_model(ARCH, B200, ac=c.activation_checkpointing, compiled=plan.stack.compile, task="full",
                                 document_mask=plan.stack.attention == "sdpa", sdpa_backend=b)
           for b in ("flash", "cudnn")}
    per = {b: o.terms(micro_batch=c.micro_batch, seq_len=c.seq_len, tp=c.tp)["attention_s"] * c.grad_accum
           for b, o in ops.items()}
    assert plan.throughput.step_terms_s["attention"] == pytest.approx(per["flash"], rel=1e-4)
    assert per["cudnn"] < 0.6 * per["flash"]
