"""benchmarks/gpu_day.py --dry-run: the GPU day's code paths on CPU with tiny shapes.

Both sides (the bundle's trainer under torchrun; pinned torchtitan's llama3 model, parallelize_llama,
loss and optimizer builders) must print a measured row for each case, beside gpuprov's predictions
for the full shape. torchtitan's wheels come from .cache/gpu-day (.ci/setup.d fetches them; else
the dry run downloads them from PyPI once).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(600)]
pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_day.py"


def test_dry_run_measures_both_sides_for_each_case():
    out = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--steps", "3"], capture_output=True, text=True,
                         timeout=560)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {}
    for line in out.stdout.splitlines():
        m = re.match(r"^(gpuprov|torchtitan|predicted)\s+(1b-full|8b-lora)\s.*?([\d,]+) tok/s", line)
        if m:
            rows[(m.group(1), m.group(2))] = float(m.group(3).replace(",", ""))
    for case in ("1b-full", "8b-lora"):
        for side in ("gpuprov", "torchtitan", "predicted"):
            assert rows.get((side, case), 0) > 0, (side, case, out.stdout)
    assert "error" not in out.stdout
    assert out.stdout.count("float8/bf16") == 2
    assert out.stdout.count("(llama3 shape)") == 2  # torchtitan's model at gpuprov's tiny shape


def test_carry_folder_is_small_and_holds_the_trainer(tmp_path):
    """--prepare without wheels: the plans' numbers and every trainer file, far under 60 MiB."""
    import json

    out = subprocess.run([sys.executable, str(SCRIPT), "--prepare", str(tmp_path), "--no-wheels"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    cases = json.loads((tmp_path / "cases.json").read_text())
    assert set(cases) == {"1b-full", "8b-lora"}
    for entries in cases.values():
        for gpu, e in entries.items():
            assert 0 < e["predicted_peak_bytes"] < e["memory_bytes"], gpu  # the planner fitted the shape
            assert e["train_yaml"]["parallel"]["sharding"] == "none"  # one GPU: no FSDP on a 1-rank mesh
    shipped = {p.name for p in (tmp_path / "launch").iterdir()}
    assert {"train.py", "train_config.py", "train_model.py", "parallel.py"} <= shipped
    assert (tmp_path / "gpu_day.py").is_file() and (tmp_path / "gpu_day_titan.py").is_file()
