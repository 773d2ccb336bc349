"""`gpuprov plan` with the layout flags: a fixed --tp reaches the plan and the bundle; bad layouts exit 2."""

from __future__ import annotations

import json
import subprocess
import sys


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprov", "plan", *args], capture_output=True, text=True)


def test_fixed_tp_reaches_the_plan_json_and_the_report() -> None:
    p = _plan("--model", "70b", "--tokens", "20B", "--tp", "4", "--json")
    assert p.returncode == 0, p.stderr
    c = json.loads(p.stdout)["cluster"]
    assert c["tp"] == 4 and c["cp"] == 1
    assert c["global_batch_tokens"] == c["micro_batch"] * c["seq_len"] * c["grad_accum"] * c["total_gpus"] // 4
    text = _plan("--model", "70b", "--tokens", "20B", "--tp", "4")
    assert "tensor parallel 4" in text.stdout


def test_layouts_the_trainer_cannot_run_exit_2_in_one_line() -> None:
    for args, words in ((("--pp", "2"), "pipeline"), (("--task", "lora", "--tp", "2"), "--task full")):
        p = _plan("--model", "70b", *args)
        assert p.returncode == 2, (args, p.stderr)
        assert words in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    bad = _plan("--model", "70b", "--tp", "0")  # click's range check, as for every count flag
    assert bad.returncode == 2 and "--tp" in bad.stderr and "Traceback" not in bad.stderr
