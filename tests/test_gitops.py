"""`gpuprov check` (drift from a regeneration, exit 0/1/2) and `gpuprov validate` (real tools)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bundle_fixtures import standin_renderers
from gpuprov import bundle
from gpuprov.commands import gitops
from plan_fixtures import sample_plan



def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=180)


def _standin_bundle(tmp_path: Path, plan=None) -> Path:
    root = tmp_path / "infra"
    bundle.write_bundle(root, bundle.build_bundle(plan or sample_plan("aws"), standin_renderers()), force=True)
    return root


# ---------------------------------------------------------------- check


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("check") / "infra"
    result = run("generate", "--model", "llama-3.1-8b", "--task", "lora", "--cloud", "gcp", "--tokens", "2B",
                 "-o", str(root))
    assert result.returncode == 0, result.stderr
    return root


def test_check_in_sync(generated: Path) -> None:
    result = run("check", str(generated))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "in sync" in result.stdout


def test_check_drift_lists_files_with_diff_then_accepts_via_lock(generated: Path, tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(generated, root, symlinks=True)
    readme = root / "README.md"
    readme.write_text(readme.read_text().replace("## How to apply", "## How to apply (edited)"))
    (root / "launch" / "env.sh").unlink()
    (root / "terraform" / "terraform.tfstate").write_text("{}")  # user file: not drift
    result = run("check", str(root))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "modified README.md" in result.stdout and "missing  launch/env.sh" in result.stdout
    assert "-## How to apply (edited)" in result.stdout and "+## How to apply" in result.stdout
    assert "tfstate" not in result.stdout and "Traceback" not in result.stderr
    # the lock is a spec file: regenerating from it restores the bundle (forced: README was edited)
    assert run("generate", "-f", str(root / bundle.LOCK_NAME), "-o", str(root)).returncode == 2
    assert run("generate", "-f", str(root / bundle.LOCK_NAME), "-o", str(root), "--force").returncode == 0
    assert run("check", str(root)).returncode == 0
    assert (root / "terraform" / "terraform.tfstate").read_text() == "{}"


def test_check_spec_change_in_lock_is_drift(generated: Path, tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(generated, root)
    lock = json.loads((root / bundle.LOCK_NAME).read_text())
    lock["spec"]["tokens"] = lock["spec"]["tokens"] * 10
    (root / bundle.LOCK_NAME).write_text(json.dumps(lock))
    result = run("check", str(root))
    assert result.returncode == 1 and "plan.json" in result.stdout


@pytest.mark.parametrize("damage", ["missing", "garbage", "bad-spec"])
def test_check_errors_exit_2(tmp_path: Path, damage: str) -> None:
    root = _standin_bundle(tmp_path)
    lock_path = root / bundle.LOCK_NAME
    if damage == "missing":
        lock_path.unlink()
    elif damage == "garbage":
        lock_path.write_text("{not json")
    else:
        lock = json.loads(lock_path.read_text())
        lock["spec"]["seq_len"] = -1
        lock_path.write_text(json.dumps(lock))
    result = run("check", str(root))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert run("check", str(tmp_path / "nowhere")).returncode == 2


# ---------------------------------------------------------------- validate


def test_validate_standin_bundle_passes(tmp_path: Path) -> None:
    root = _standin_bundle(tmp_path)
    result = run("validate", str(root))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = {line.split()[1] + " " + line.split()[2]: line.split()[0] for line in result.stdout.splitlines()}
    assert lines["terraform fmt"] == "ok" and lines["ansible syntax"] == "ok" and lines["bash -n"] == "ok"


def test_validate_finds_each_kind_of_breakage(tmp_path: Path) -> None:
    root = _standin_bundle(tmp_path)
    (root / "terraform" / "main.tf").write_text('output "x" {\nvalue = 1\n}\n')  # not canonical
    (root / "launch" / "train.sh").write_text("#!/bin/bash\nif then fi\n")
    (root / "ansible" / "site.yml").write_text("- hosts: gpu_nodes\n  tasks:\n    - no_such_module_xyz: {}\n")
    result = run("validate", str(root))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "fail  terraform fmt     not in canonical format: main.tf" in result.stdout
    assert "fail  bash -n" in result.stdout and "launch/train.sh" in result.stdout
    assert "fail  ansible syntax" in result.stdout
    assert "Traceback" not in result.stderr


def test_validate_terraform_syntax_error(tmp_path: Path) -> None:
    root = _standin_bundle(tmp_path)
    (root / "terraform" / "main.tf").write_text('resource "x" "y" {\n  a = (\n}\n')
    status, detail = gitops.check_terraform_fmt(root)
    assert status == "fail"
    status, detail = gitops.check_terraform_config(root)
    assert status == "fail" and "main.tf:3" in detail


def test_validate_onprem_has_no_terraform(tmp_path: Path) -> None:
    root = _standin_bundle(tmp_path, sample_plan("onprem"))
    assert gitops.check_terraform_fmt(root)[0] == "n/a"  # nothing to check: never a failure, even --strict
    # two nodes and no shared filesystem: the trainer would refuse at start, so validate fails with the fix
    result = run("validate", str(root))
    assert result.returncode == 1 and "fail  shared storage" in result.stdout, result.stdout + result.stderr
    assert "shared_storage_mount" in result.stdout
    inventory = root / "ansible" / "inventory.yml"
    inventory.write_text(inventory.read_text().replace(
        "all:\n", 'all:\n  vars:\n    shared_storage_mount: {fstype: nfs, source: "nfs:/gpu", mount_point: /shared}\n', 1))
    result = run("validate", str(root))
    assert result.returncode == 0, result.stdout + result.stderr
    assert run("validate", str(root), "--strict").returncode == 0, "n/a (nothing to check) is not a skip"


def test_validate_strict_fails_on_a_skip(tmp_path: Path) -> None:
    from gpuprov.catalog import bringup as cat

    plan = sample_plan("azure", nodes=1)
    root = _standin_bundle(tmp_path, plan)
    # a region of Azure's the catalog does not list the VM size in: only the live check can say
    other = next(r for r in cat.known_regions("azure")[0] if r != plan.instance.region)
    (root / "terraform" / "terraform.tfvars").write_text(f'location = "{other}"\n')
    result = run("validate", str(root), "--offline")
    assert result.returncode == 0, result.stdout + result.stderr
    statuses = {ln.split()[0] for ln in result.stdout.splitlines() if ln.strip()}
    assert "skip" in statuses and "fail" not in statuses, result.stdout
    strict = run("validate", str(root), "--offline", "--strict")
    assert strict.returncode == 1 and "check(s) failed" in strict.stderr


def test_plan_sanity_detects_a_plan_that_no_longer_fits(tmp_path: Path) -> None:
    plan = sample_plan("aws")
    root = _standin_bundle(tmp_path, plan)
    assert gitops.check_plan(root)[0] == "ok"
    gone = plan.model_copy(update={"instance": plan.instance.model_copy(update={"name": "p9.retired"})})
    (root / bundle.PLAN_NAME).write_text(bundle.plan_json(gone))
    assert gitops.check_plan(root) == ("fail", "instance type p9.retired is no longer in the catalog")
    big = plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"micro_batch": 4096})})
    (root / bundle.PLAN_NAME).write_text(bundle.plan_json(big))
    status, detail = gitops.check_plan(root)
    assert status == "fail" and "no longer fits" in detail


def test_validate_not_a_bundle(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    result = run("validate", str(tmp_path / "x"))
    assert result.returncode == 2 and "not a gpuprov bundle" in result.stderr


def test_validate_real_bundle(generated: Path) -> None:
    result = run("validate", str(generated))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok    plan fits" in result.stdout


def test_validate_terraform_config_catches_what_fmt_cannot(tmp_path: Path) -> None:
    root = _standin_bundle(tmp_path)
    # well formatted HCL, but an invalid configuration: a validation rule must refer to its own variable
    (root / "terraform" / "variables.tf").write_text(
        'variable "a" {\n  type = string\n  validation {\n    condition     = var.b != ""\n'
        '    error_message = "a must be set."\n  }\n}\n')
    assert gitops.check_terraform_fmt(root)[0] == "ok"
    status, detail = gitops.check_terraform_config(root)
    assert status == "fail" and "variables.tf:4: Invalid variable validation condition" in detail
