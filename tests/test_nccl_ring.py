"""FSDP's collectives timed as NCCL's tuning model times a ring (gpuprov/sizing/nccl.py): protocol by protocol,
the fastest one winning, so the bus bandwidth a collective reaches grows with its message size."""

from __future__ import annotations

import pytest

from gpuprov.catalog import load_data
from gpuprov.sizing.nccl import bus_bandwidth, fsdp_ring_seconds, ring_seconds

NVLINK_BUS, IB_BUS = 360.0, 340.0  # GB/s, the large-message (Simple) bus bandwidths


def test_smaller_messages_reach_a_lower_bus_bandwidth():
    sizes = [2.0 ** k for k in range(10, 32, 3)]  # 1 KiB to 1 GiB
    bws = [bus_bandwidth(s, 8, 1, NVLINK_BUS, NVLINK_BUS) for s in sizes]
    assert all(a < b for a, b in zip(bws, bws[1:]))
    assert bws[0] < 0.01 * NVLINK_BUS  # latency-bound
    assert bws[-1] == pytest.approx(NVLINK_BUS, rel=0.01)  # Simple protocol at the link's bus bandwidth


def test_the_fastest_protocol_wins_and_small_messages_cost_the_ll_latency():
    r = load_data("throughput.yaml")["communication"]["nccl_ring"]
    ll_us = r["base_latency_us"]["ll"] + 7 * r["hop_latency_us"]["nvlink"]["ll"]
    simple_us = r["base_latency_us"]["simple"] + 7 * r["hop_latency_us"]["nvlink"]["simple"]
    assert ring_seconds(8.0, 8, 1, NVLINK_BUS, NVLINK_BUS) == pytest.approx(ll_us * 1e-6, rel=1e-3)
    big = 2.0 ** 30
    assert ring_seconds(big, 8, 1, NVLINK_BUS, NVLINK_BUS) == pytest.approx(
        simple_us * 1e-6 + big * 7 / 8 / (NVLINK_BUS * 1e9), rel=1e-6)


def test_rings_across_nodes_pay_network_hops():
    one_node = ring_seconds(1 << 20, 8, 1, IB_BUS, NVLINK_BUS)
    sixteen = ring_seconds(1 << 20, 128, 16, IB_BUS, NVLINK_BUS)
    assert sixteen > 5 * one_node  # 127 hops, 15 of them over the network
    assert ring_seconds(1 << 20, 1, 1, IB_BUS, NVLINK_BUS) == 0.0
    # PCIe-only nodes (bus bandwidth below any NVLink) pay PCIe's longer hops
    assert ring_seconds(64.0, 8, 1, 20.0, 20.0) > ring_seconds(64.0, 8, 1, 20.0, NVLINK_BUS)


def test_fsdp_splits_the_step_into_per_layer_rings():
    gather, grad = 16e9, 32e9  # an 8B model: bf16 gathers, fp32 reduce-scatters
    deep, shallow = (fsdp_ring_seconds(gather, grad, layers, 128, 8, IB_BUS, NVLINK_BUS) for layers in (320, 32))
    assert deep > shallow  # the same bytes in more, smaller messages: more latency
    bandwidth_only = 127 / 128 * (2 * gather + grad) / (IB_BUS * 1e9)
    assert shallow > bandwidth_only
