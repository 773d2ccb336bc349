"""A ring all-gather or reduce-scatter timed as NCCL's own tuning model times it, protocol by protocol.

NCCL picks, per call, the protocol (LL, LL128, Simple) its model says is fastest for the message: each has a
fixed latency per ring step and a share of the link's bus bandwidth, so small messages run latency-bound at a
fraction of the bandwidth large ones reach. Figures in catalog/data/throughput.yaml communication.nccl_ring.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from gpuprov.catalog import load_data

PROTOCOLS = ("ll", "ll128", "simple")
# above the fastest PCIe x16 link's effective bandwidth, a node's collectives ride NVLink
_NVLINK_ABOVE_GBYTES = 64.0


@lru_cache(maxsize=1)
def _ring() -> dict[str, Any]:
    return dict(load_data("throughput.yaml")["communication"]["nccl_ring"])


@lru_cache(maxsize=4096)
def _protocols(ranks: int, nodes: int, nvlink: bool) -> tuple[tuple[float, float], ...]:
    """(latency s, fraction of the bus bandwidth x ranks / steps) per protocol for a ring of `ranks` on `nodes`."""
    r = _ring()
    steps, inter = ranks - 1, max(0, nodes - 1)
    hop = r["hop_latency_us"]["nvlink" if nvlink else "pci"]
    factor = r["bus_bw_factor"]["inter_node" if nodes > 1 else "intra_node"]
    return tuple(((r["base_latency_us"][p] + (steps - inter) * hop[p] + inter * r["hop_latency_us"]["net"][p]) * 1e-6,
                  float(factor[p]) * ranks / steps) for p in PROTOCOLS)


def ring_seconds(nbytes: float, ranks: int, nodes: int, bus_gbytes: float, intra_gbytes: float) -> float:
    """One ring all-gather (nbytes: the gathered output) or reduce-scatter (nbytes: the input) over `ranks` GPUs on
    `nodes` nodes at `bus_gbytes` bus bandwidth (NCCL's Simple protocol, the large-message figure): NCCL's
    latency + bytes / algorithm bandwidth of the fastest protocol, in seconds."""
    if ranks <= 1:
        return 0.0
    per_byte = 1.0 / (bus_gbytes * 1e9)
    protocols = _protocols(ranks, nodes, intra_gbytes > _NVLINK_ABOVE_GBYTES)
    return min(lat + nbytes * per_byte / share for lat, share in protocols)


def bus_bandwidth(nbytes: float, ranks: int, nodes: int, bus_gbytes: float, intra_gbytes: float) -> float:
    """The bus bandwidth (GB/s) a ring collective of `nbytes` reaches, as nccl-tests reports it:
    (ranks - 1) / ranks x bytes / time."""
    t = ring_seconds(nbytes, ranks, nodes, bus_gbytes, intra_gbytes)
    return (ranks - 1) / ranks * nbytes / t / 1e9 if t > 0 else 0.0


@lru_cache(maxsize=8192)  # the planner asks for the same few groups and buffers across its candidates
def fsdp_ring_seconds(gather_buf: float, grad_buf: float, layers: int, group: int, gpus_per_node: int,
                      bus_gbytes: float, intra_gbytes: float) -> float:
    """One micro-batch of FSDP's per-layer collectives: each layer's forward all-gather, backward re-gather
    (reshard_after_forward) and gradient reduce-scatter, each a ring of that layer's message size."""
    nodes = -(-group // gpus_per_node)
    per_layer = (2 * ring_seconds(gather_buf / layers, group, nodes, bus_gbytes, intra_gbytes)
                 + ring_seconds(grad_buf / layers, group, nodes, bus_gbytes, intra_gbytes))
    return layers * per_layer
