"""The plan states its own error: `time_hours_range` spans the throughput model's extreme errors on its
hold-out (benchmarks/holdout-throughput.yaml), recorded by `benchmarks/throughput.py --record`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_record_is_what_the_benchmark_measures_now():
    """A change to the model that moves the hold-out's error must re-record it (no stale range)."""
    from gpuprov.sizing.time_error import holdout_error

    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "throughput.py"), "--json"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    now = json.loads(r.stdout)["hold-out (all)"]["summary"]
    rec = holdout_error()
    assert (rec["rows"], rec["mape_pct"], rec["worst_over_pct"], rec["worst_under_pct"]) == (
        now["rows"], now["mape_pct"], now["worst_over_pct"], now["worst_under_pct"])


@pytest.fixture(scope="module")
def plan() -> dict:
    r = subprocess.run([sys.executable, "-m", "gpuprov", "plan", "--model", "llama-3.1-8b", "--cloud", "aws",
                        "--tokens", "1B", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_plan_json_carries_the_range(plan):
    from gpuprov.sizing.time_error import holdout_error

    low, high = plan["time_hours_range"]
    assert low < plan["time_hours"] < high
    train_h = plan["training"]["steps"] * plan["throughput"]["step_time_s"] / 3600.0
    e = holdout_error()
    # the training steps' part scales by (1 + e) at the hold-out's extremes; start-up stays as planned
    assert high - plan["time_hours"] == pytest.approx(train_h * e["worst_over_pct"] / 100, abs=2e-3)
    assert low - plan["time_hours"] == pytest.approx(train_h * e["worst_under_pct"] / 100, abs=2e-3)
    for row in plan["candidates"]:
        lo, hi = row["time_hours_range"]
        assert lo < row["time_hours"] < hi


def test_summary_and_table_show_it(plan):
    r = subprocess.run([sys.executable, "-m", "gpuprov", "plan", "--model", "llama-3.1-8b", "--cloud", "aws",
                        "--tokens", "1B"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    low, high = plan["time_hours_range"]
    assert f"measured runs: {low:,.1f}-{high:,.1f} h" in r.stdout
    chosen = next(line for line in r.stdout.splitlines() if line.startswith("  *"))
    assert f"({low:,.1f}-{high:,.1f})" in chosen
