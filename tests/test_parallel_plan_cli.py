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
    assert "layout TP4 x " in text.stdout  # the one layout label


def test_layouts_the_trainer_cannot_run_exit_2_in_one_line() -> None:
    for args, words in ((("--pp", "2", "--task", "lora"), "--task full"), (("--task", "lora", "--tp", "2"), "--task full")):
        p = _plan("--model", "70b", *args)
        assert p.returncode == 2, (args, p.stderr)
        assert words in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    # the trainer runs pipeline stages (catalog facts with their source): plan lays PP out (tests/test_plan_pp.py)
    from gpuprov.catalog import load_data

    facts = load_data("trainer.yaml")["pipeline"]
    assert facts["stages"] is True and facts["source"] and "full" in facts["tasks"]
    bad = _plan("--model", "70b", "--tp", "0")  # click's range check, as for every count flag
    assert bad.returncode == 2 and "--tp" in bad.stderr and "Traceback" not in bad.stderr


def test_explain_counts_tokens_per_step_over_data_parallel_ranks() -> None:
    """With TP the global batch is micro-batch x seq x (GPUs / tp) x accumulation, and explain says so."""
    c = json.loads(_plan("--model", "70b", "--tokens", "20B", "--tp", "4", "--json").stdout)["cluster"]
    p = subprocess.run([sys.executable, "-m", "gpuprov", "explain", "--model", "70b", "--tokens", "20B", "--tp", "4"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    line = next(ln for ln in p.stdout.splitlines() if "tokens per step =" in ln)
    dp = c["total_gpus"] // 4
    assert f"x {dp} data-parallel ranks" in line, line
    assert c["micro_batch"] * c["seq_len"] * dp * c["grad_accum"] == c["global_batch_tokens"]
    assert f"= {c['global_batch_tokens']:,};" in line
