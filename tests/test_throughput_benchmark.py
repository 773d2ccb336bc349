"""benchmarks/throughput.py runs, keeps its files apart and README quotes what it prints."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("gpuprov_throughput_bench", REPO / "benchmarks" / "throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_calibration_and_hold_out_are_disjoint_and_sourced() -> None:
    b = _bench()
    cal, held = b.load_rows(b.CALIBRATION), b.load_rows(b.HOLDOUT)
    assert len(cal) >= 6 and len(held) >= 8
    assert not {r["id"] for r in cal} & {r["id"] for r in held}
    for row in cal + held:
        assert "@" in row["source"] and row["measured"] > 0, row["id"]


def test_readme_quotes_the_current_figures() -> None:
    b = _bench()
    cal = b.summary(b.evaluate(b.load_rows(b.CALIBRATION)))
    held = b.summary(b.evaluate(b.load_rows(b.HOLDOUT)))
    text = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    m = re.search(r"read MAPE ([\d.]+)%; the hold-out rows .*? read MAPE ([\d.]+)%, worst over-prediction "
                  r"([+-][\d.]+)% .*? worst under-prediction ([+-][\d.]+)%", text)
    assert m, "README's throughput paragraph is missing"
    assert float(m.group(1)) == cal["mape_pct"]
    assert float(m.group(2)) == held["mape_pct"]
    assert float(m.group(3)) == held["worst_over_pct"]
    assert float(m.group(4)) == held["worst_under_pct"]


def test_prints_the_table_and_the_targets(capsys) -> None:
    assert _bench().main([]) == 0
    out = capsys.readouterr().out
    assert "== hold-out" in out and "targets on the hold-out" in out
    assert len(re.findall(r"^titan-|^trainy-", out, flags=re.M)) >= 14
