"""A LoRA run's merged model is asked for at generate time (`--export-merged`, spec `export_merged`):
`up` submits the bundle's job as written, so train.yaml must already say it (no `--set` reaches it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BASE = ["--model", "llama-3.1-8b", "--cloud", "aws", "--gpus", "8"]


def _generate(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprov", "generate", *BASE, *args, "-o", str(tmp_path / "b")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)


def _merged(tmp_path: Path) -> tuple[bool, bool]:
    train = yaml.safe_load((tmp_path / "b" / "launch" / "train.yaml").read_text())
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    return train["export"]["merged"], plan["training"]["export_merged"]


@pytest.mark.parametrize("task", ["lora", "qlora"])
def test_export_merged_reaches_train_yaml(tmp_path, task):
    made = _generate(tmp_path, "--task", task, "--export-merged")
    assert made.returncode == 0, made.stderr
    assert _merged(tmp_path) == (True, True)


def test_no_merged_model_unless_asked(tmp_path):
    made = _generate(tmp_path, "--task", "lora")
    assert made.returncode == 0, made.stderr
    assert _merged(tmp_path) == (False, False)


def test_the_spec_file_asks_for_it_too(tmp_path):
    (tmp_path / "gpuprov.yaml").write_text("task: lora\nexport_merged: true\n")
    made = _generate(tmp_path, "-f", "gpuprov.yaml")
    assert made.returncode == 0, made.stderr
    assert _merged(tmp_path) == (True, True)


def test_a_full_fine_tune_has_nothing_to_merge(tmp_path):
    made = _generate(tmp_path, "--task", "full", "--export-merged")
    assert made.returncode == 2 and "Traceback" not in made.stderr
    assert len(made.stderr.strip().splitlines()) == 1 and "export_merged" in made.stderr, made.stderr
    assert not (tmp_path / "b").exists()
