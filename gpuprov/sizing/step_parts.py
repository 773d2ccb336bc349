"""Pieces of a step: what FSDP2's layer-by-layer prefetch leaves exposed, a step estimate by kind of work, and a
step as a calibration says it runs."""

from __future__ import annotations

import dataclasses
from typing import Any


def fsdp_exposed_seconds(comm_s: float, compute_s: float, gather_buf: float, grad_buf: float, layers: int) -> float:
    """What FSDP2's per-micro-batch collectives leave exposed, layer by layer as it schedules them.

    FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_state.py, _fsdp_param_group.py: implicit forward
    prefetch of the next layer's all-gather on the all-gather stream, backward prefetch of the previous
    layer's, the reduce-scatter on its own stream behind the next layer's backward) hides layer i+1's
    all-gather under layer i's forward, and layer i-1's all-gather plus layer i+1's reduce-scatter under layer
    i's backward. The pass's first all-gather and its last reduce-scatter have nothing to hide under.
    `comm_s`: one micro-batch's all-gathers (forward and backward) and reduce-scatter; the forward takes a
    third of `compute_s` (backward twice the forward's FLOPs)."""
    ag = comm_s * gather_buf / (2.0 * gather_buf + grad_buf)  # one pass of all-gathers
    rs = comm_s - 2.0 * ag
    ag_l, rs_l = ag / layers, rs / layers
    fwd_l, bwd_l = compute_s / 3.0 / layers, 2.0 * compute_s / 3.0 / layers
    return ag_l + rs_l + (layers - 1) * (max(0.0, ag_l - fwd_l) + max(0.0, ag_l + rs_l - bwd_l))


STEP_TERMS = ("gemm", "attention", "memory_bound", "launch", "exposed_comm", "optimizer", "pipeline_bubble")


def step_breakdown(est: Any) -> dict[str, float]:
    """The step's seconds by kind (STEP_TERMS), summing to its step time: the operation model's compute terms
    over the step's micro-batches (ring attention's merges and async TP's local reductions count as memory-bound),
    the communication compute could not hide, the optimizer step and the pipeline bubble. {} for a step timed
    without the operation model."""
    t = est.terms
    if "gemm_per_micro_batch_s" not in t:
        return {}
    ga = float(t.get("micro_batches", 1))
    r = 1.0 / float(t.get("calibration_speed_ratio", 1.0))  # an older whole-step calibration scales every term
    out = {k: t[f"{k}_per_micro_batch_s"] * ga * r for k in ("gemm", "attention", "memory_bound", "launch")}
    on_stream = t.get("cp_merge_per_micro_batch_s", 0.0) + t.get("async_tp_reduce_per_micro_batch_s", 0.0)
    out["memory_bound"] += on_stream * ga * r
    out.update(exposed_comm=est.exposed_comm_s, optimizer=est.optimizer_time_s,
               pipeline_bubble=t.get("pipeline_bubble_s", 0.0) * r)
    return out


def calibrated(est: Any, speed_ratio: float) -> Any:
    """The step as a measured run on this GPU type says it goes (gpuprov/calibration.py RULE): every
    time term divided by measured/predicted tokens/s, tokens/s and MFU multiplied by it."""
    if speed_ratio == 1.0:
        return est
    r = float(speed_ratio)
    return dataclasses.replace(est, step_time_s=est.step_time_s / r, compute_time_s=est.compute_time_s / r,
                               comm_time_s=est.comm_time_s / r, exposed_comm_s=est.exposed_comm_s / r,
                               optimizer_time_s=est.optimizer_time_s / r, tokens_per_s=est.tokens_per_s * r,
                               mfu=est.mfu * r, terms=dict(est.terms, calibration_speed_ratio=r))
