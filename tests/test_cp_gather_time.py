"""CP on packed documents is timed as gpuprov's trainer runs it: key/value all-gathers and a gradient
reduce-scatter per layer, none hidden, masked attention over the whole window with its forward run again
(gpuprov/sizing/throughput.py cp_gather_seconds, operators.attention_forwards_again)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from gpuprov.catalog.gpus import get_gpu
from gpuprov.catalog.models import get_model
from gpuprov.planner import make_plan
from gpuprov.sizing import operators
from gpuprov.sizing.throughput import (
    LayerShape, Shape, flops_per_token, inter_node_gbytes, intra_node_gbytes, layout_step_estimate,
)
from gpuprov.spec import TrainingSpec
from gpuprov.stack import attention_kernel, document_mask

H100 = get_gpu("h100-80gb")
ARCH = get_model("llama-3.1-8b")  # GQA: 8 key/value heads of 32
SEQ, CP = 32768, 4


def _estimate(*, gather: bool, ac: str = "selective", projected: int | None = None):
    shape = Shape(nodes=1, gpus_per_node=8, sharding="fsdp", shard_group=8, micro_batch=1, grad_accum=1, seq_len=SEQ)
    layer = LayerShape(ARCH.num_layers, ARCH.hidden_size, ARCH.q_dim, ARCH.kv_dim if projected is None else projected)
    ops = operators.op_model(ARCH, H100, ac=ac, cp_gather=gather)
    return layout_step_estimate(
        shape=shape, tp=1, cp=CP, layer=layer, ac=ac, flops=flops_per_token(ARCH, SEQ, "full", ARCH.params, ac),
        peak_tflops=H100.bf16_tflops, util=0.4, hbm_gbytes_per_s=H100.hbm_gbytes_per_s,
        intra_gbytes=intra_node_gbytes(H100)[0], inter_gbytes=inter_node_gbytes("infiniband", 400.0),
        params=ARCH.params, trainable=ARCH.params, num_layers=ARCH.num_layers, task="full", ops=ops)


def test_the_gathers_are_all_exposed_and_move_the_projected_keys_and_values():
    ring, gather = _estimate(gather=False), _estimate(gather=True)
    t = gather.terms
    assert t["cp_exposed_per_micro_batch_s"] == t["cp_ring_per_micro_batch_s"] > 0  # nothing hides them
    assert ring.terms["cp_exposed_per_micro_batch_s"] < ring.terms["cp_ring_per_micro_batch_s"]  # the ring overlaps
    # transformers repeats GQA heads after the gather: the gathered width is the projections' (8 of 32 heads)
    repeated = _estimate(gather=True, projected=ARCH.q_dim).terms
    assert t["cp_ring_per_micro_batch_s"] < repeated["cp_ring_per_micro_batch_s"] / 2


@pytest.mark.parametrize("ac, passes", [("none", 3), ("selective", 4), ("full", 4)])
def test_each_pass_the_trainer_makes_is_timed(ac, passes):
    """Forward gather, the checkpoints' regathers and the gradients' reduce-scatter: bandwidth and latency per pass."""
    base = _estimate(gather=True, ac="none").terms["cp_ring_per_micro_batch_s"] / 3
    assert _estimate(gather=True, ac=ac).terms["cp_ring_per_micro_batch_s"] == pytest.approx(passes * base, rel=1e-12)


def test_the_gathered_attention_computes_every_tile_and_its_forward_again():
    ring, gather = (_estimate(gather=g).terms["attention_per_micro_batch_s"] for g in (False, True))
    assert gather == pytest.approx(ring * 2 * (1 + 1 / 3.5), rel=1e-12)  # the square, and one forward (1 of 3.5) again
    assert {k: v for k, v in _estimate(gather=False).terms.items() if k.startswith("gemm")} == \
        {k: v for k, v in _estimate(gather=True).terms.items() if k.startswith("gemm")}


@pytest.mark.parametrize("model", ["llama-3.1-8b", "gemma-2-9b"])
def test_a_cp_plan_times_the_attention_its_trainer_runs(model):
    """Under CP the trainer's cp_attention replaces every model's attention (Gemma 2's flash_attention_2 too)."""
    plan = make_plan(TrainingSpec(model=model, tokens=10**9, cloud="aws", gpus=["h100-80gb"], seq_len=65536, cp=2,
                                  pp=1))
    c, arch = plan.cluster, get_model(model)
    assert c.cp == 2 and document_mask(plan.stack, c.cp)
    assert plan.stack.attention_kernel == attention_kernel("sdpa", 2)
    timed = {g: operators.op_model(arch, H100, ac=c.activation_checkpointing, compiled=plan.stack.compile,
                                   cp_gather=g).terms(micro_batch=c.micro_batch, seq_len=c.seq_len, tp=c.tp, cp=c.cp)
             for g in (False, True)}
    attention = plan.throughput.step_terms_s["attention"]
    assert attention == pytest.approx(timed[True]["attention_s"] * c.grad_accum, rel=1e-4)
    assert attention > 1.5 * timed[False]["attention_s"] * c.grad_accum


def test_published_ring_runs_stay_ring():
    """op_model without cp_gather (benchmarks' torchtitan rows) keeps ring attention's causal half."""
    ops = operators.op_model(ARCH, H100, ac="selective")
    assert not ops.gathers(CP)
    window = dataclasses.replace(ops, cp_gather=True)
    assert window.gathers(CP) and not window.gathers(1)


def test_explain_reports_the_gathers_all_exposed():
    """`gpuprov explain --json` on a CP plan: the trainer's exchange is counted whole as exposed, and the step is the
    plan's."""
    args = ["--model", "llama-3.1-8b", "--seq-len", "65536", "--cp", "2", "--pp", "1", "--json"]
    explained, planned = (subprocess.run([sys.executable, "-m", "gpuprov", command, *args], capture_output=True,
                                         text=True, timeout=120) for command in ("explain", "plan"))
    assert explained.returncode == 0 and planned.returncode == 0, explained.stderr + planned.stderr
    step = json.loads(explained.stdout)["step"]
    assert step["terms_s"]["cp_exposed_per_micro_batch_s"] == step["terms_s"]["cp_ring_per_micro_batch_s"] > 0
    assert step["step_time_s"] == json.loads(planned.stdout)["throughput"]["step_time_s"]
