"""Settings a user fixes (`--activation-checkpointing`, `--micro-batch`, `--grad-accumulation`,
`--compile/--no-compile`, or the same spec-file keys) the planner keeps; it chooses only the rest.
Through the real CLI: parsed `plan --json`, exit codes, and the train.yaml `generate` writes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def plan(*args: str) -> dict:
    r = run("plan", "--model", "llama-3.1-8b", "--cloud", "aws", "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def chosen() -> dict:
    return plan()


def test_unfixed_the_planner_chooses(chosen):
    # the reference the fixed runs differ from: without flags this spec plans no recompute
    assert chosen["cluster"]["activation_checkpointing"] == "none"
    assert chosen["stack"]["compile"] is True


def test_fixed_recompute_and_micro_batch_are_kept(chosen):
    d = plan("--activation-checkpointing", "full", "--micro-batch", "2", "--gpus", "8")
    c = d["cluster"]
    assert (c["activation_checkpointing"], c["micro_batch"], c["total_gpus"]) == ("full", 2, 8)
    assert d["spec"]["activation_checkpointing"] == "full" and d["spec"]["micro_batch"] == 2
    # full recompute runs the forward again: the same GPUs take longer per token than the planner's choice
    same = plan("--gpus", "8", "--gpu", c["gpu"], "--micro-batch", "2")
    assert same["cluster"]["activation_checkpointing"] != "full"
    assert d["throughput"]["tokens_per_s"] < same["throughput"]["tokens_per_s"]


def test_fixed_accumulation_and_the_batch_it_makes():
    d = plan("--micro-batch", "2", "--grad-accumulation", "4", "--gpus", "16")
    c = d["cluster"]
    assert (c["micro_batch"], c["grad_accum"], c["total_gpus"]) == (2, 4, 16)
    dp = c["total_gpus"] // (c["tp"] * c["cp"] * c["pp"])
    # the GPUs, micro-batch and accumulation the user gave make the batch (no batch stated)
    assert c["global_batch_tokens"] == 2 * 4 * c["seq_len"] * dp


def test_no_compile_is_kept_and_timed_eager(chosen):
    c = chosen["cluster"]
    same = ("--gpu", c["gpu"], "--gpus", str(c["total_gpus"]), "--activation-checkpointing",
            c["activation_checkpointing"], "--micro-batch", str(c["micro_batch"]), "--grad-accumulation", str(c["grad_accum"]))
    d, compiled = plan("--no-compile", *same), plan(*same)
    assert d["stack"]["compile"] is False and d["spec"]["compile"] is False and compiled["stack"]["compile"] is True
    assert d["cluster"]["instance_type"] == compiled["cluster"]["instance_type"]
    assert d["throughput"]["tokens_per_s"] < compiled["throughput"]["tokens_per_s"]


def test_spec_file_keys(tmp_path):
    spec = tmp_path / "gpuprov.yaml"
    spec.write_text("model: llama-3.1-8b\ncloud: aws\ngpu_count: 8\nactivation_checkpointing: selective\n"
                    "micro_batch: 1\ngrad_accumulation: 3\ncompile: false\n")
    r = run("plan", "-f", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    c = d["cluster"]
    assert (c["activation_checkpointing"], c["micro_batch"], c["grad_accum"]) == ("selective", 1, 3)
    assert d["stack"]["compile"] is False
    # a flag overrides the file's key
    r = run("plan", "-f", str(spec), "--grad-accumulation", "2", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["cluster"]["grad_accum"] == 2


def test_generate_runs_what_was_fixed(tmp_path):
    out = tmp_path / "infra"
    r = run("generate", "--model", "llama-3.1-8b", "--cloud", "aws", "--gpus", "8", "--activation-checkpointing",
            "full", "--micro-batch", "4", "--grad-accumulation", "2", "--no-compile", "-o", str(out))
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(next(out.rglob("train.yaml")).read_text())
    assert cfg["parallel"]["activation_checkpointing"] == "full"
    assert (cfg["batch"]["micro_batch"], cfg["batch"]["grad_accum"]) == (4, 2)
    assert cfg["efficiency"]["compile"] is False


@pytest.mark.parametrize("args, words", [
    (("--task", "qlora", "--compile"), "--no-compile"),
    (("--model", "70b", "--pp", "4", "--grad-accumulation", "3"), "at least --pp 4"),
    (("--micro-batch", "8"), "--global-batch-tokens"),
    (("--micro-batch", "0"), "--micro-batch"),
    (("--activation-checkpointing", "some"), "--activation-checkpointing"),
])
def test_bad_settings_exit_2_in_one_line(args, words):
    r = run("plan", "--model", "llama-3.1-8b", "--cloud", "aws", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert words in r.stderr and "Traceback" not in r.stderr


def test_nothing_fits_names_the_fixed_settings():
    r = run("plan", "--model", "70b", "--cloud", "aws", "--gpus", "8", "--activation-checkpointing", "none",
            "--micro-batch", "32")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "leave --activation-checkpointing none --micro-batch 32 to the planner" in r.stderr
