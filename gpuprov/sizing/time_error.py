"""The plan's time as a range: the throughput model's measured error on runs it was not shaped on.

benchmarks/throughput.py --record writes the hold-out's signed errors, e = (predicted - measured) /
measured tokens/s (catalog/data/throughput_error.yaml). A run predicted with error e takes (1 + e) x the
predicted step time, so the training part of the plan's hours spans (1 + e_min) .. (1 + e_max) of what
was predicted, e over the hold-out rows: the extremes seen, not a confidence interval. Start-up,
checkpoint writes and preemption are not throughput and stay as planned.
"""

from __future__ import annotations

from functools import lru_cache

from gpuprov.catalog import load_data


@lru_cache(maxsize=1)
def holdout_error() -> dict:
    return dict(load_data("throughput_error.yaml")["holdout"])


def time_range(time_hours: float, train_hours: float) -> tuple[float, float]:
    """(low, high) hours of a plan whose `time_hours` includes `train_hours` of training steps."""
    e = holdout_error()
    low = time_hours + train_hours * float(e["worst_under_pct"]) / 100.0
    high = time_hours + train_hours * float(e["worst_over_pct"]) / 100.0
    return round(max(low, 0.0), 3), round(high, 3)
