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
    cal, held, published = b.load_rows(b.CALIBRATION), b.load_rows(b.HOLDOUT), b.load_rows(b.HOLDOUT_PUBLISHED)
    assert len(cal) >= 6 and len(held) >= 8 and len(published) >= 12
    ids = [r["id"] for r in cal + held + published]
    assert len(ids) == len(set(ids))
    for row in cal + held:
        assert "@" in row["source"] and row["measured"] > 0, row["id"]
    for row in published:  # a commit, or the blog post's file in its site repository
        assert ("@" in row["source"] or "_posts/" in row["source"]) and row["measured"] > 0, row["id"]
    # no catalog figure cites the IBM/Meta table (the async-TP file is cited only for float8 under TP being run)
    catalog = " ".join(p.read_text(encoding="utf-8") for p in (REPO / "gpuprov" / "catalog" / "data").glob("*.yaml"))
    assert "maximizing-training" not in catalog


def test_readme_quotes_the_published_hold_out() -> None:
    b = _bench()
    pub = b.summary(b.evaluate(b.load_rows(b.HOLDOUT_PUBLISHED)))
    both = b.summary(b.evaluate(b.load_rows(b.HOLDOUT) + b.load_rows(b.HOLDOUT_PUBLISHED)))
    text = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    m = re.search(r"holdout-published-throughput.yaml.*? reads MAPE ([\d.]+)%, worst over-prediction ([+-][\d.]+)% "
                  r".*? worst under-prediction ([+-][\d.]+)% .*? Over all (\d+) hold-out rows the MAPE is ([\d.]+)%", text)
    assert m, "README's published hold-out sentence is missing"
    assert (float(m.group(1)), float(m.group(2)), float(m.group(3))) == (
        pub["mape_pct"], pub["worst_over_pct"], pub["worst_under_pct"])
    assert (int(m.group(4)), float(m.group(5))) == (both["rows"], both["mape_pct"])


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
