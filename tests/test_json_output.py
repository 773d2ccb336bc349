"""`--json` on every command that reports: one object on stdout with the keys README's "JSON
output" section lists, and errors as {"error", "exit"} on stdout under --json."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "70b-full-aws-p5" / "bundle"


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True, timeout=180,
                          env=env)


def documented_keys(command: str) -> set[str]:
    """The keys README's JSON output section lists for a command (`- gpuprov CMD --json: `k1`, ...`)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("### JSON output", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    line = next(ln for ln in section.splitlines() if ln.startswith(f"- `gpuprov {command}"))
    top = re.sub(r"\([^)]*\)", "", line.split(":", 1)[1])  # nested keys are listed in parentheses
    return set(re.findall(r"`([a-z_]+)`", top))


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("json") / "infra"
    r = run("generate", "--model", "8b", "--task", "lora", "--cloud", "aws", "-o", str(root), "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert set(report) == documented_keys("generate")
    assert report["bundle"] == str(root) and report["files"] == sum(1 for p in root.rglob("*") if p.is_file())
    assert report["tokens_assumed"]  # no --tokens or --dataset: the fine-tune default
    plan = json.loads((root / "plan.json").read_text())
    assert report["instance_type"] == plan["instance"]["name"] and report["nodes"] == plan["cluster"]["nodes"]
    assert report["training_tokens"] == plan["training"]["tokens"] and report["cost_usd"] == plan["cost_usd"]
    assert r.stderr == ""  # the summary is the JSON, nothing else
    return root


def test_generate_json_refuses_a_tar_on_stdout():
    r = run("generate", "--model", "8b", "-o", "-", "--json")
    assert r.returncode == 2 and json.loads(r.stdout)["exit"] == 2


def test_validate_json_lists_every_check(bundle_dir: Path):
    r = run("validate", str(bundle_dir), "--offline", "--json")
    report = json.loads(r.stdout)
    assert set(report) == documented_keys("validate")
    names = [c["name"] for c in report["checks"]]
    assert names[:6] == ["terraform fmt", "terraform config", "ansible syntax", "bash -n", "added files", "plan fits"]
    assert all(set(c) == {"name", "status", "detail", "fix", "kind"} for c in report["checks"])
    assert report["counts"]["ok"] == sum(c["status"] == "ok" for c in report["checks"])
    assert r.returncode == report["exit"]


def test_validate_json_reports_a_failure_with_exit_1(bundle_dir: Path, tmp_path: Path):
    import shutil

    root = tmp_path / "broken"
    shutil.copytree(bundle_dir, root, symlinks=True)
    (root / "launch" / "train.sh").write_text("#!/bin/bash\nif then fi\n")
    r = run("validate", str(root), "--offline", "--json")
    report = json.loads(r.stdout)  # one object: the report, not a second error object
    assert r.returncode == 1 and report["exit"] == 1 and report["failed"] >= 1
    assert next(c for c in report["checks"] if c["name"] == "bash -n")["status"] == "fail"


def test_validate_that_checked_nothing_does_not_pass(bundle_dir: Path, monkeypatch):
    """With neither terraform nor ansible-playbook, every tool check skips: validate says it checked
    nothing and exits 1 (it used to exit 0 as if all had passed)."""
    from click.testing import CliRunner

    from gpuprov.commands import gitops

    monkeypatch.setattr(gitops, "_terraform", lambda args, cwd: None)
    monkeypatch.setattr(gitops, "_find_tool", lambda name: None)
    result = CliRunner().invoke(gitops.validate, [str(bundle_dir), "--offline", "--json"])
    report = json.loads(result.stdout)
    assert result.exit_code == 1 and report["exit"] == 1 and not report["tool_checks_ran"]
    assert {c["status"] for c in report["checks"] if c["kind"] == "tool"} == {"skip"}
    text = CliRunner().invoke(gitops.validate, [str(bundle_dir), "--offline"])
    assert text.exit_code == 1 and "checked nothing" in text.stderr


def test_check_json_in_sync_and_drift(bundle_dir: Path, tmp_path: Path):
    r = run("check", str(bundle_dir), "--json")
    report = json.loads(r.stdout)
    assert r.returncode == 0 and set(report) == documented_keys("check")
    assert report["in_sync"] and report["differences"] == [] and report["exit"] == 0
    import shutil

    root = tmp_path / "drift"
    shutil.copytree(bundle_dir, root, symlinks=True)
    (root / "launch" / "env.sh").unlink()
    r = run("check", str(root), "--json")
    report = json.loads(r.stdout)
    assert r.returncode == 1 and report["exit"] == 1 and not report["in_sync"]
    assert {"path": "launch/env.sh", "status": "missing"}.items() <= report["differences"][0].items()
    assert report["accept"].startswith("gpuprov generate -f ")


def test_explain_json_carries_the_numbers_the_text_prints():
    args = ("explain", "--model", "8b", "--task", "lora", "--tokens", "100M")
    data = json.loads(run(*args, "--json").stdout)
    assert set(data) == documented_keys("explain")
    plan = json.loads(run("plan", *args[1:], "--json").stdout)
    assert data["memory"]["per_gpu_bytes"] == plan["memory"]["per_gpu_bytes"]
    assert sum(data["memory"]["terms_bytes"].values()) == pytest.approx(plan["memory"]["per_gpu_bytes"], rel=0.02)
    assert data["step"]["step_time_s"] == plan["throughput"]["step_time_s"] and data["time_hours"] == plan["time_hours"]
    text = run(*args).stdout
    assert f"{data['step']['step_time_s']:,.3f} s" in text


def test_up_dry_run_json_lists_the_steps_in_order(bundle_dir: Path):
    r = run("up", str(bundle_dir), "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert set(report) == documented_keys("up")
    text = run("up", str(bundle_dir), "--dry-run").stdout
    for step in report["steps"]:
        assert f"{step['number']}. {step['command']}" in text
    assert report["steps"][0]["argv"][:2] == ["terraform", "init"]
    r = run("up", str(bundle_dir), "--json")  # --json without --dry-run would stream tool output
    assert r.returncode == 2 and json.loads(r.stdout)["exit"] == 2


def test_hosts_probe_json_reads_each_host(tmp_path: Path):
    """A stand-in `ssh` prints a recorded probe of an HGX A100 node (tests/data/probe)."""
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\ncat {ROOT / 'tests' / 'data' / 'probe' / 'hgx-a100-80gb.txt'}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("- {name: gpu0, address: 10.0.0.10}\n- {name: gpu1, address: 10.0.0.11}\n")
    env = dict(os.environ, PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    r = run("hosts", "probe", str(hosts), "--json", env=env)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert set(report) == documented_keys("hosts probe")
    assert [h["name"] for h in report["hosts"]] == ["gpu0", "gpu1"] and not report["written"]
    assert report["hosts"][0]["gpu"] == "a100-80gb" and report["hosts"][0]["gpus"] == 8


@pytest.mark.parametrize("args", [("validate", "/nonexistent-bundle", "--json"), ("check", "/nonexistent", "--json"),
                                  ("explain", "--model", "no-such-model-x", "--json"),
                                  ("up", "/nonexistent", "--dry-run", "--json")])
def test_errors_are_json_under_json(args):
    r = run(*args)
    assert r.returncode == 2 and set(json.loads(r.stdout)) == {"error", "exit"}
