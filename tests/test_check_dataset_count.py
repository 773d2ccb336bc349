"""`gpuprov check` on a fresh fine-tune bundle whose --dataset is a local JSONL file: the lock keeps how
the dataset was counted, so a regeneration describes the count as generate did, from any working
directory. Before, the plan's note counted the file again with the lock's model path (relative to the
bundle) taken from the working directory: generate called a tokenized count "an estimate" and `check`
from the bundle's folder found drift."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def _gpuprov(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=ENV)


def test_check_is_in_sync_from_anywhere_after_an_estimated_dataset_count(tmp_path):
    pytest.importorskip("transformers")
    from finetune_inputs import make_base, write_chat

    user = tmp_path / "user"
    user.mkdir()
    make_base(user / "tiny-llama")
    write_chat(user / "chat.jsonl", count=48)  # every record tokenized with the model's tokenizer: measured
    made = _gpuprov("generate", "--model", "tiny-llama", "--dataset", "chat.jsonl", "--task", "lora", "--cloud", "aws",
                    "--gpus", "2", "--seq-len", "64", "-o", "bundle", cwd=user)
    assert made.returncode == 0, made.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for cwd in (user, user / "bundle", elsewhere):
        checked = _gpuprov("check", str(user / "bundle"), cwd=cwd)
        assert checked.returncode == 0, f"from {cwd}: {checked.stdout[-2000:]}{checked.stderr[-500:]}"
    lock = json.loads((user / "bundle" / "gpuprov.lock").read_text())
    assert lock["spec"]["dataset_tokens_how"] == "measured"
    plan = json.loads((user / "bundle" / "plan.json").read_text())
    note = next(n for n in plan["notes"] if n.startswith("Dataset:"))
    assert note.startswith(f"Dataset: {lock['spec']['dataset_tokens']:,} tokens per pass"), note  # no "~"
