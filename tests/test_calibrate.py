"""`gpuprov calibrate BUNDLE METRICS.jsonl -o FILE` and `plan/generate --calibration FILE`: a measured run
fed back into the plan, through the real CLI (exit codes, parsed --json, the files written)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

SETUP = ("--model", "llama-3.1-8b", "--cloud", "aws", "--gpu", "h100-80gb", "--gpus", "8")


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def metrics_file(path: Path, plan: dict, speed: float) -> Path:
    """A metrics file as launch/train_metrics.py writes it, for a run at `speed` x the plan's tokens/s
    (the first logged interval slower: compile and warm-up)."""
    t, mem = plan["throughput"], plan["memory"]["per_gpu_bytes"]
    lines = [{"event": "start", "step": 0, "world": 8}]
    for i, k in enumerate((0.3, speed, speed * 1.02, speed * 0.98, speed)):
        lines.append({"step": 10 * (i + 1), "loss": 2.0, "lr": 1e-5, "grad_norm": 1.0, "tokens_per_s": t["tokens_per_s"] * k,
                      "mfu": t["mfu"] * k, "peak_memory_reserved_bytes": int(mem * 1.05),
                      "peak_memory_allocated_bytes": int(mem * 0.9), "skipped_steps": 0})
    lines.append({"event": "end", "peak_memory_reserved_bytes": int(mem * 1.1), "plan_memory_per_gpu_bytes": mem})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("cal") / "infra"
    r = run("generate", *SETUP, "-o", str(root))
    assert r.returncode == 0, r.stderr
    return root, json.loads((root / "plan.json").read_text())


@pytest.fixture(scope="module")
def half(bundle, tmp_path_factory) -> tuple[Path, dict]:
    root, plan = bundle
    d = tmp_path_factory.mktemp("half")
    out = d / "h100.calibration.yaml"
    r = run("calibrate", str(root), str(metrics_file(d / "metrics.jsonl", plan, 0.5)), "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    return out, json.loads(r.stdout)


def test_calibrate_prints_measured_against_predicted(half, bundle):
    out, report = half
    _, plan = bundle
    rows = {r["quantity"]: r for r in report["rows"]}
    assert rows["tokens/s (cluster)"]["ratio"] == pytest.approx(0.5)
    assert rows["tokens/s (cluster)"]["predicted"] == pytest.approx(plan["throughput"]["tokens_per_s"])
    assert rows["MFU"]["ratio"] == pytest.approx(0.5)
    assert rows["peak memory per GPU (bytes)"]["ratio"] == pytest.approx(1.1, rel=1e-3)
    written = yaml.safe_load(out.read_text())
    assert (written["gpu"], written["speed_ratio"], written["gpu_power_w"]) == ("h100-80gb", 0.5, 700)
    assert written["memory_ratio"] == pytest.approx(1.1, rel=1e-3)


def test_half_the_speed_doubles_the_training_hours(half, bundle):
    out, _ = half
    _, before = bundle
    r = run("plan", *SETUP, "--calibration", str(out), "--json")
    assert r.returncode == 0, r.stderr
    after = json.loads(r.stdout)
    train = [p["training"]["steps"] * p["throughput"]["step_time_s"] / 3600 for p in (before, after)]
    # the calibration solved the GEMMs' throughput that gives this layout the measured speed (6 digits kept)
    assert train[1] == pytest.approx(2 * train[0], rel=1e-4)
    assert after["throughput"]["tokens_per_s"] == pytest.approx(before["throughput"]["tokens_per_s"] / 2, rel=1e-4)
    assert after["time_hours"] > before["time_hours"]
    assert any(n.startswith("GEMM throughput x ") and " on h100-80gb" in n for n in after["notes"])
    cal = after["spec"]["calibration"][0]
    assert cal["speed_ratio"] == 0.5 and cal["gemm_efficiency_ratio"] < 0.5


def test_calibration_scales_the_gemm_term_only(half, bundle):
    """Half the measured speed is put on the GEMMs: they take more than twice as long, while attention and
    the memory-bound work stay as modelled."""
    out, _ = half
    _, before = bundle
    after = json.loads(run("plan", *SETUP, "--calibration", str(out), "--json").stdout)
    b, a = before["throughput"]["step_terms_s"], after["throughput"]["step_terms_s"]
    assert a["gemm"] > 2 * b["gemm"]
    assert a["attention"] == pytest.approx(b["attention"], rel=1e-6)
    assert a["memory_bound"] == pytest.approx(b["memory_bound"], rel=1e-6)
    assert sum(a.values()) == pytest.approx(after["throughput"]["step_time_s"], rel=1e-4)


def test_an_older_calibration_without_a_gemm_ratio_scales_the_whole_step(bundle, tmp_path):
    _, before = bundle
    old = tmp_path / "old.calibration.yaml"
    old.write_text("gpu: h100-80gb\nspeed_ratio: 0.5\n")
    after = json.loads(run("plan", *SETUP, "--calibration", str(old), "--json").stdout)
    assert after["throughput"]["tokens_per_s"] == pytest.approx(before["throughput"]["tokens_per_s"] / 2, rel=1e-6)
    assert any(n.startswith("Step time x 1/0.5 on h100-80gb") for n in after["notes"])


def test_another_gpu_type_is_left_as_modelled(half):
    out, _ = half
    a100 = [a if a != "h100-80gb" else "a100-80gb" for a in SETUP]
    plain, cal = run("plan", *a100, "--json"), run("plan", *a100, "--calibration", str(out), "--json")
    assert plain.returncode == cal.returncode == 0, cal.stderr
    p, c = json.loads(plain.stdout), json.loads(cal.stdout)
    assert c["throughput"]["tokens_per_s"] == p["throughput"]["tokens_per_s"]
    assert any("not applied" in n for n in c["notes"])


def test_explain_says_the_gemms_carry_the_measured_ratio(half):
    out, _ = half
    r = run("explain", *SETUP, "--calibration", str(out))
    assert r.returncode == 0, r.stderr
    assert "its GEMMs at x" in r.stdout and "measured at 0.5x the predicted tokens/s" in r.stdout


@pytest.mark.parametrize("body, words", [
    ('{"event": "start"}\nnot json\n', "line 2"),
    ('{"event": "start"}\n{"event": "end"}\n', "no logged step"),
    ('{"step": 10, "tokens_per_s": -5}\n', "non-negative"),
    ('{"step": 10, "tokens_per_s": "fast"}\n', "tokens_per_s"),
    ('[1, 2]\n', "not a JSON object"),
    ('{"step": 10, "tokens_per_s": 1e12}\n', "outside"),
])
def test_bad_metrics_file_exits_2_in_one_line(bundle, tmp_path, body, words):
    root, _ = bundle
    bad = tmp_path / "metrics.jsonl"
    bad.write_text(body)
    r = run("calibrate", str(root), str(bad), "-o", str(tmp_path / "out.yaml"))
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in r.stderr
    assert not (tmp_path / "out.yaml").exists()  # nothing half-written


def test_missing_metrics_and_bad_calibration_exit_2(bundle, tmp_path):
    root, _ = bundle
    r = run("calibrate", str(root), str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "o.yaml"))
    assert r.returncode == 2 and "no such file" in r.stderr
    junk = tmp_path / "junk.yaml"
    junk.write_text("hello: world\n")
    r = run("plan", *SETUP, "--calibration", str(junk))
    assert r.returncode == 2 and "not a calibration file" in r.stderr and "Traceback" not in r.stderr
    junk.write_text("gpu: h100-80gb\nspeed_ratio: 900\n")
    r = run("plan", *SETUP, "--calibration", str(junk))
    assert r.returncode == 2 and "speed_ratio" in r.stderr and "Traceback" not in r.stderr
