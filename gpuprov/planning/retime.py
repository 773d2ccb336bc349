"""A plan's own step, timed again as the planner timed it: what `explain` prints term by term and what
`calibrate` solves a measured run's GEMM throughput from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuprov.catalog.gpus import get_gpu
from gpuprov.catalog.models import get_model
from gpuprov.sizing.operators import op_model
from gpuprov.stack import cp_gathers, document_mask
from gpuprov.sizing.throughput import (
    LayerShape, Shape, flops_per_token, inter_node_gbytes, intra_node_gbytes, layout_step_estimate, pipelined,
    power_capped,
)


@dataclass(frozen=True)
class PlanStep:
    arch: Any
    gpu: Any
    fl: Any  # FLOPs per token
    st: Any  # the step estimate
    ops: Any  # the operation model it was timed with
    intra: float
    link: str
    inter: float


def _float8_kw(plan: Any, arch: Any) -> dict:
    """The step estimate's float8 arguments, as the planner passed them (the Plan's gain)."""
    if plan.throughput.float8_gain == 1.0:
        return {}
    return {"float8_gain": plan.throughput.float8_gain, "float8_params": arch.num_layers * arch.layer_linear_params()}


def _calibration(plan: Any) -> Any:
    """The calibration the plan applied to its GPU type (None without one)."""
    return next((c for c in plan.spec.calibration or [] if c.gpu == plan.gpu.slug), None)


def _compiled(spec: Any, plan: Any) -> bool:
    """Whether the plan's stack runs torch.compile (as the planner timed it)."""
    return plan.stack.compile if plan.stack is not None else True


def plan_step(plan: Any, gemm_scale: float | None = None) -> PlanStep:
    """The step of the plan's layout; `gemm_scale` replaces the calibration's GEMM ratio (None: the plan's own)."""
    spec = plan.spec
    arch, gpu = get_model(spec.model), get_gpu(plan.gpu.slug)
    c, t = plan.cluster, plan.throughput
    trainable = plan.model.trainable_params
    fl = flops_per_token(arch, c.seq_len, plan.task, trainable, c.activation_checkpointing)
    intra, link = intra_node_gbytes(gpu)
    inter = inter_node_gbytes(plan.fabric.name, plan.fabric.gbps_per_gpu) if c.nodes > 1 else 0.0
    shape, pipeline = pipelined(Shape(nodes=c.nodes, gpus_per_node=c.gpus_per_node, sharding=c.sharding,
                                      shard_group=c.replica_gpus, micro_batch=c.micro_batch, grad_accum=c.grad_accum,
                                      seq_len=c.seq_len), c.pp, c.pp_schedule)
    layer = LayerShape(arch.num_layers, arch.hidden_size,
                       arch.q_dim if arch.num_kv_heads < arch.num_attention_heads else arch.kv_dim, arch.kv_dim)
    timed = power_capped(gpu, t.gpu_power_w)  # the GPU at the power limit the plan was timed at
    cal = _calibration(plan)
    ops = op_model(arch, timed, ac=c.activation_checkpointing, compiled=_compiled(spec, plan), task=plan.task,
                   trainable=trainable, gemm_scale=gemm_scale if gemm_scale is not None else
                   float(getattr(cal, "gemm_efficiency_ratio", None) or 1.0),
                   document_mask=plan.stack is not None and document_mask(plan.stack), cp_gather=cp_gathers(plan.stack))
    st = layout_step_estimate(shape=shape, tp=c.tp, cp=c.cp, layer=layer, ac=c.activation_checkpointing,
                              flops=fl, peak_tflops=gpu.bf16_tflops, util=t.mfu_assumed,
                              hbm_gbytes_per_s=timed.hbm_gbytes_per_s, intra_gbytes=intra, inter_gbytes=inter or intra,
                              params=plan.model.params, trainable=trainable, num_layers=arch.num_layers,
                              task=plan.task, optimizer=c.optimizer, precision=c.precision, offload=c.offload,
                              pcie_gen=gpu.pcie_gen, pipeline=pipeline, ops=ops, **_float8_kw(plan, arch))
    return PlanStep(arch, gpu, fl, st, ops, intra, link, inter)
