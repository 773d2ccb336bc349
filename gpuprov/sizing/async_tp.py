"""Async tensor parallelism as torch's micro-pipeline TP pass rewrites a step: what stays exposed and what it adds.

torchtitan's enable_async_tensor_parallel turns on Inductor's micro-pipeline TP pass, which replaces TP's
all-gather -> matmul and matmul -> reduce-scatter pairs by torch's symmetric-memory fused ops. Plain numbers in
and out (gpuprov.sizing.throughput.layout_step_estimate calls these); figures in catalog/data/throughput.yaml
model_parallel, each with its source.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from gpuprov.catalog import load_data


@lru_cache(maxsize=1)
def _model_parallel() -> dict[str, Any]:
    return dict(load_data("throughput.yaml")["model_parallel"])


@lru_cache(maxsize=1)
def _float8_gather_bytes() -> float:
    return float(load_data("memory_constants.yaml")["float8"]["gather_bytes"])


def async_tp_exposed_seconds(tp_s: float, gemm_s: float, *, tp: int, ac: str, float8: bool = False) -> float:
    """Per micro-batch: what async TP leaves of the TP collectives `tp_s` (tp_comm_seconds) on the critical path.

    Inductor's micro-pipeline TP pass fuses each all-gather with the matmuls that read its result and each
    reduce-scatter with the one matmul that produces its input; those hide under their matmul's shards, all but
    the last reduce-scatter shard (torch fused_matmul_reduce_scatter has no matmul after it). The backward
    reduce-scatters of the attention and MLP inputs' gradients sum several linears' gradients first, so they
    stay plain collectives (catalog/data/throughput.yaml model_parallel.async_tp_unfused_reduce_scatters_per_layer)."""
    if tp <= 1 or tp_s <= 0.0:
        return 0.0
    mp = _model_parallel()
    calls = mp["tp_allreduces_forward_per_layer"] + mp["tp_allreduces_backward_per_layer"]
    if ac in ("selective", "full"):
        calls += mp["tp_allreduces_forward_per_layer"]
    gather_bytes = _float8_gather_bytes() if float8 else 2.0
    unfused = float(mp["async_tp_unfused_reduce_scatters_per_layer"]) * 2.0 / (calls * (gather_bytes + 2.0))
    fused_s = tp_s * (1.0 - unfused)
    return tp_s * unfused + max(0.0, fused_s - gemm_s) + fused_s / (2.0 * tp)


def async_tp_reduce_seconds(*, tokens: float, layer: Any, tp: int, ac: str, hbm_gbytes_per_s: float) -> float:
    """Per micro-batch: the local reductions async TP's fused matmul-reduce-scatters run on the compute stream.

    torch's _fused_matmul_reduce_scatter_impl (and its scaled-mm twin) has every rank compute its partial product
    for every rank's rows into a stacked buffer (tokens x hidden, bf16), which _pipelined_produce_and_all2all fills
    across the ranks, then sums the tp partials of its own rows in one reduction kernel: it reads the whole stacked
    buffer and writes 1/tp of it. NCCL's reduce-scatter reduces inside its own kernel instead. The fused ones are the
    forward's (attention output and MLP down projections), again in a recomputed forward."""
    if tp <= 1:
        return 0.0
    mp = _model_parallel()
    fused = mp["tp_allreduces_forward_per_layer"] * (2 if ac in ("selective", "full") else 1)
    moved = tokens * layer.hidden * 2.0 * (1.0 + 1.0 / tp)
    return layer.num_layers * fused * moved / (hbm_gbytes_per_s * 1e9)


def async_tp_seconds(tp_s: float, gemm_s: float, *, tokens: float, layer: Any, tp: int, ac: str, float8: bool,
                     hbm: float) -> tuple[float, float]:
    """(TP collectives left exposed, local reductions on the compute stream) of one micro-batch under async TP."""
    return (async_tp_exposed_seconds(tp_s, gemm_s, tp=tp, ac=ac, float8=float8),
            async_tp_reduce_seconds(tokens=tokens, layer=layer, tp=tp, ac=ac, hbm_gbytes_per_s=float(hbm)))
