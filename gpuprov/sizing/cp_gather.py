"""Context parallelism on packed documents, as gpuprov's trainer runs it: what each layer's key/value
all-gathers and gradient reduce-scatter cost per micro-batch (templates/launch/train_attention.py cp_attention).
Published runs use ring attention instead (throughput.py cp_exposed_seconds)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuprov.sizing.operators import cp_gather_passes

if TYPE_CHECKING:  # throughput.py imports this module
    from gpuprov.sizing.throughput import LayerShape


def cp_gather_seconds(*, tokens: float, layer: LayerShape, tp: int, cp: int, gbytes: float, latency: float, ac: str,
                      hbm_gbytes_per_s: float) -> tuple[float, float]:
    """Per micro-batch under CP with documents, as gpuprov's trainer runs it (templates/launch/train_attention.py
    cp_attention, _GatherSeq): (collective seconds, copy seconds).

    Each layer all-gathers its keys and values over the CP group (operators.cp_gather_passes times: the forward
    and the recomputes) and reduce-scatters their gradients once, in bf16, at the width the projections produce
    (transformers repeats GQA heads after the gather). The calls block the compute stream and nothing else is
    issued meanwhile, so all of it is exposed. Around them, on the compute stream: each gather concatenates the cp
    parts and backward splits the whole window's gradients into contiguous chunks (a read and a write of the
    whole window's K and V each)."""
    if cp == 1:
        return 0.0, 0.0
    width = layer.projected_kv_width or layer.kv_width
    kv = 2.0 * width / tp * tokens  # local K and V elements
    passes = cp_gather_passes(ac) + 1  # the all-gathers, then the gradients' reduce-scatter
    received = layer.num_layers * passes * (cp - 1) * kv * 2.0
    comm = received / (gbytes * 1e9) + layer.num_layers * passes * 2 * (cp - 1) * latency  # K and V: two calls a pass
    copies = layer.num_layers * passes * 2.0 * cp * kv * 2.0
    return comm, copies / (hbm_gbytes_per_s * 1e9)
