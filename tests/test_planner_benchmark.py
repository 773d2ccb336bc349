"""benchmarks/planner.py plans every case it times (a case the catalog can no longer plan fails here,
not in someone's terminal)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_case_plans(capsys) -> None:
    spec = importlib.util.spec_from_file_location("gpuprov_planner_bench", REPO / "benchmarks" / "planner.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--no-brute", "--repeat", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["rows"]) == len(bench.CASES)
    for row in out["rows"]:
        assert row["planner_score"] is not None and row["planner_score"] > 0, row["case"]
