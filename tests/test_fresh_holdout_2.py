"""benchmarks/fresh-holdout-2-throughput.yaml: torchtune's fine-tuning runs, each predicted or marked why not."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from gpuprov.catalog.gpus import list_gpus
from gpuprov.catalog.models import get_model
from gpuprov.sizing.throughput import float8_gain

from test_fresh_holdout import REPO, _load  # the benchmarks loaded as modules, one way

FILE = REPO / "benchmarks" / "fresh-holdout-2-throughput.yaml"


def test_rows_are_sourced_and_apart_from_every_other_file() -> None:
    b = _load("gpuprov_throughput_bench_f2", "throughput.py")
    rows = b.load_rows(FILE)
    others = [r for p in (b.CALIBRATION, b.HOLDOUT, b.HOLDOUT_PUBLISHED,
                          REPO / "benchmarks" / "fresh-holdout-throughput.yaml") for r in b.load_rows(p)]
    assert len(rows) >= 15 and len({r["id"] for r in rows}) == len(rows)
    assert not {r["id"] for r in rows} & {r["id"] for r in others}
    assert not {r["source"].split("@")[0] for r in rows} & {r["source"].split("@")[0] for r in others}
    for row in rows:
        assert "@" in row["source"] and row.get("table") and row["measured"] > 0, row["id"]
        assert row["task"] in ("full", "lora", "qlora") and int(row["micro_batch"]) > 0, row["id"]
        assert row["task"] == "full" or (row["lora_rank"] > 0 and row["lora_targets"]), row["id"]


def test_every_row_predicts_or_states_why_not() -> None:
    b = _load("gpuprov_throughput_bench_f2e", "throughput.py")
    rows = b.load_rows(FILE)
    results = b.evaluate(rows)
    assert [r["id"] for r in results] == [r["id"] for r in rows]
    reasons = set(b.REASONS)
    catalog = {g.slug for g in list_gpus()}
    for row, res in zip(rows, results):
        unmodelled = any(row.get(k) for k in b.UNMODELLED) or "seq_len" not in row or row["gpu"] not in catalog \
            or row.get("low_precision_recipe") or (row.get("float8") and row.get("float8_recipe") != "tensorwise") \
            or (row.get("float8") and not float8_gain(b.gpu_of(row), get_model(row["model"]).params))
        if unmodelled:
            assert res["predicted"] is None and res["error_pct"] is None, row["id"]
            assert res["not_predicted"] and set(res["not_predicted"].split("; ")) <= reasons, row["id"]
        else:
            assert "not_predicted" not in res and res["predicted"] > 0 and math.isfinite(res["error_pct"]), row["id"]
    predicted_tasks = {row["task"] for row, res in zip(rows, results) if res["predicted"] is not None}
    assert predicted_tasks == {"full", "lora", "qlora"}
    s = b.summary(results)
    assert s["rows"] + s["not_predicted"] == len(rows) and s["rows"] >= 8


def test_lora_row_is_timed_as_the_planner_times_it(tmp_path) -> None:
    """The benchmark's prediction of a LoRA row is the plan's tokens/s for the same settings."""
    b = _load("gpuprov_throughput_bench_f2p", "throughput.py")
    row = next(r for r in b.load_rows(FILE) if r["id"] == "tt-8b-lora-4090")
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("- {name: box, address: 10.0.0.1, user: ubuntu, gpu: rtx-4090-24gb, gpus: 1}\n", encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "gpuprov", "plan", "--model", row["model"], "--task", "lora",
                        "--lora-rank", str(row["lora_rank"]), "--lora-targets", ",".join(row["lora_targets"]),
                        "--hosts", str(hosts), "--seq-len", str(row["seq_len"]), "--micro-batch", str(row["micro_batch"]),
                        "--grad-accumulation", "1", "--activation-checkpointing", "full", "--compile",
                        "--precision", "bf16", "--global-batch-tokens", str(row["micro_batch"] * row["seq_len"]),
                        "--tokens", "100M", "--json"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["cluster"]["sharding"] == row["sharding"] and plan["cluster"]["total_gpus"] == 1
    # the plan's trainer hands SDPA a dense per-document mask on packed data (stack.document_mask); the row's
    # torchtune run did not, so the benchmark predicts it with that one setting added
    assert plan["stack"]["attention"] == "sdpa"
    assert math.isclose(plan["throughput"]["tokens_per_s"], b.predict({**row, "document_mask": True}).tokens_per_s,
                        rel_tol=1e-9)
    assert plan["throughput"]["tokens_per_s"] < b.predict(row).tokens_per_s  # every score tile costs time


def test_file_option_prints_every_row(capsys) -> None:
    f = _load("gpuprov_fresh_bench_f2", "fresh_holdout.py")
    assert f.main(["--file", str(FILE), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = f.throughput.load_rows(FILE)
    assert [r["id"] for r in data["rows"]] == [r["id"] for r in rows]
    s = data["summary"]
    assert s["rows"] + s["not_predicted"] + s.get("not_scored", 0) == len(rows)
    # a row whose figure is above its GPU's dense peak is shown and left out of the MAPE, whatever its error
    unscored = [r for r in data["rows"] if r.get("not_scored")]
    assert len(unscored) == s.get("not_scored", 0) and all(r["measured_over_peak"] > 1.0 for r in unscored)
    assert all(r["measured_over_peak"] <= 1.0 for r in data["rows"]
               if r["predicted"] is not None and not r.get("not_scored") and "measured_over_peak" in r)
    assert f.main(["--file", str(FILE)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert all(any(line.startswith(r["id"]) for line in out) for r in rows)
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fresh_holdout.py"), "--file", "missing.yaml"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_nothing_in_the_model_reads_the_file() -> None:
    readers = [p for p in list((REPO / "gpuprov").rglob("*.py")) + list((REPO / "gpuprov").rglob("*.yaml"))
               + list((REPO / "benchmarks").glob("*.py"))
               if "fresh-holdout-2-throughput" in p.read_text(encoding="utf-8")]
    assert [p.name for p in readers] == ["fresh_holdout.py"]


def test_a_rows_sdpa_backend_is_timed_or_the_row_is_not_predicted() -> None:
    """A row's stated SDPA backend times its attention (cuDNN on the B200 row is faster than flash); a backend
    with no measurement on the row's GPU class makes the row not predicted, with that reason."""
    b = _load("gpuprov_throughput_bench_f2s", "throughput.py")
    row = next(r for r in b.load_rows(FILE) if r["id"] == "b200-8b-bf16")
    assert row["sdpa_backend"] == "cudnn"
    cudnn, flash = b.predict(row), b.predict({**row, "sdpa_backend": "flash"})
    assert cudnn.terms["attention_per_micro_batch_s"] < 0.6 * flash.terms["attention_per_micro_batch_s"]
    assert b.not_predicted(row) is None
    hopper = {**row, "gpu": "h100-80gb"}
    hopper.pop("gpu_power_w")
    assert b.not_predicted(hopper) == b.NO_ATTENTION
