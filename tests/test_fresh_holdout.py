"""benchmarks/fresh_holdout.py: a hold-out apart from every other throughput file, sourced row by row, printed whole."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _load(name: str, file: str):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return module


def test_fresh_rows_are_sourced_and_apart_from_every_other_file() -> None:
    b = _load("gpuprov_throughput_bench_f", "throughput.py")
    fresh = b.load_rows(REPO / "benchmarks" / "fresh-holdout-throughput.yaml")
    others = [r for p in (b.CALIBRATION, b.HOLDOUT, b.HOLDOUT_PUBLISHED) for r in b.load_rows(p)]
    assert len(fresh) >= 8
    assert not {r["id"] for r in fresh} & {r["id"] for r in others}
    # no run of another file again: the same source and table
    assert not {(r["source"], r.get("table")) for r in fresh} & {(r["source"], r.get("table")) for r in others}
    for row in fresh:
        assert ("@" in row["source"] or "_posts/" in row["source"]) and row.get("table"), row["id"]
        assert row["measured"] > 0 and int(row["seq_len"]) > 0 and int(row["micro_batch"]) > 0, row["id"]


def test_nothing_in_the_model_or_the_other_benchmarks_reads_the_fresh_file() -> None:
    readers = [p for p in list((REPO / "gpuprov").rglob("*.py")) + list((REPO / "gpuprov").rglob("*.yaml"))
               + list((REPO / "benchmarks").glob("*.py"))
               if "fresh-holdout-throughput" in p.read_text(encoding="utf-8")]
    assert [p.name for p in readers] == ["fresh_holdout.py"]


def test_prints_every_row_and_the_targets(capsys) -> None:
    f = _load("gpuprov_fresh_bench", "fresh_holdout.py")
    assert f.main([]) == 0
    out = capsys.readouterr().out
    rows = f.throughput.load_rows(f.FRESH)
    assert all(any(line.startswith(r["id"]) for line in out.splitlines()) for r in rows)
    assert "targets: MAPE <= 12%" in out
    assert f.main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["rows"] == len(rows) and len(data["rows"]) == len(rows)


def test_readme_quotes_the_fresh_hold_out() -> None:
    f = _load("gpuprov_fresh_bench_r", "fresh_holdout.py")
    s = f.throughput.summary(f.throughput.evaluate(f.throughput.load_rows(f.FRESH)))
    text = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    m = re.search(r"fresh-holdout-throughput.yaml.*? reads MAPE ([\d.]+)%, worst over-prediction ([+-][\d.]+)%", text)
    assert m, "README's fresh hold-out sentence is missing"
    assert (float(m.group(1)), float(m.group(2))) == (s["mape_pct"], s["worst_over_pct"])


def test_fresh_peaks_are_sourced_apart_and_estimated() -> None:
    acc = _load("gpuprov_accuracy_bench_f", "accuracy.py")
    fresh = acc.load_rows(REPO / "benchmarks" / "fresh-holdout-peaks.yaml")
    others = [r for name in ("measured-peaks.yaml", "more-measured-peaks.yaml", "torchtitan-parallel-peaks.yaml")
              for r in acc.load_rows(REPO / "benchmarks" / name)]
    assert len(fresh) >= 5
    assert not {r["id"] for r in fresh} & {r["id"] for r in others}
    # the same published figure is not in another file (its table row, without the commit the others may omit)
    def cell(r):
        return r["source"].split("@")[0].split(",")[0], r["source"].split(",", 1)[-1].strip(), r["measured"]
    assert not {cell(r) for r in fresh} & {cell(r) for r in others}
    for row in fresh:
        assert "@" in row["source"] and row["measured"] > 0, row["id"]
    results = acc.evaluate(fresh)
    assert [r["id"] for r in results] == [r["id"] for r in fresh]
    assert all(r["estimated_bytes"] > 0 and r["metric"] == "reserved" for r in results)
