"""The slurm role's job staging (tasks/job.yml) with the real ansible-playbook on this machine (connection
local): launch/ arrives as one archive with each file's content and mode, owned by the job's user; check mode
on a fresh node writes nothing, a second run changes nothing, an edited file is staged again, and no archive
is left on the controller."""

from __future__ import annotations

import getpass
import grp
import json
import os
from pathlib import Path

import pytest
import yaml

from ansible_helpers import LOCAL_INVENTORY, REPO, playbook, recap

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# as root (CI), another user than the one running the play, so the owner is one the role set, not the default
OWNER = "nobody" if os.geteuid() == 0 else getpass.getuser()
LAUNCH = {"train.sh": ("#!/usr/bin/env bash\necho train\n", 0o755), "train.py": ("print('step')\n", 0o644),
          "train.yaml": ("steps: 10\n", 0o644)}


def _bundle(root: Path) -> Path:
    launch = root / "launch"
    launch.mkdir()
    for name, (text, mode) in LAUNCH.items():
        (launch / name).write_text(text)
        (launch / name).chmod(mode)
    (root / "roles").symlink_to(REPO / "ansible" / "roles")
    (root / "inventory.yml").write_text(json.dumps(LOCAL_INVENTORY))
    (root / "ansible.cfg").write_text("[defaults]\nroles_path = roles\n")
    shared = root / "shared"
    variables = {"slurm_job_dir": str(shared / "jobs" / "t"), "slurm_log_dir": str(shared / "logs" / "t"),
                 "slurm_checkpoint_dir": str(shared / "checkpoints" / "t"), "slurm_job_source": f"{launch}/",
                 "slurm_job_owner": OWNER, "slurm_job_group": grp.getgrgid(os.getgid()).gr_name}
    (root / "job.yml").write_text(yaml.safe_dump([{
        "name": "job files", "hosts": "gpu_nodes", "become": False, "gather_facts": False,
        "tasks": [{"name": "stage", "ansible.builtin.include_role": {"name": "slurm", "tasks_from": "job.yml"},
                   "vars": variables}]}], sort_keys=False))
    return shared / "jobs" / "t" / "launch"


def test_launch_files_arrive_as_one_archive_idempotent_and_check_mode_safe(tmp_path, monkeypatch):
    staged = _bundle(tmp_path)
    controller_tmp = tmp_path / "controller-tmp"  # where the controller's temporary archive is made
    controller_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(controller_tmp))
    check = playbook(tmp_path, "-i", "inventory.yml", "job.yml", "--check")
    assert check.returncode == 0, check.stdout[-3000:]
    assert not (tmp_path / "shared").exists()  # check mode wrote nothing on the node

    first = playbook(tmp_path, "-i", "inventory.yml", "job.yml", "-v")
    assert first.returncode == 0 and recap(first.stdout)["changed"] > 0, first.stdout[-3000:]
    assert f"{controller_tmp}/" in first.stdout and ".launch.tar.gz" in first.stdout  # the archive was made there
    assert sorted(p.name for p in staged.iterdir()) == sorted(LAUNCH)
    for name, (text, mode) in LAUNCH.items():
        assert (staged / name).read_text() == text and (staged / name).stat().st_mode & 0o777 == mode
        assert (staged / name).owner() == OWNER
    assert staged.stat().st_mode & 0o777 == 0o775  # the folder as the role sets it, not as the archive had it

    second = playbook(tmp_path, "-i", "inventory.yml", "job.yml")
    assert second.returncode == 0 and recap(second.stdout)["changed"] == 0, second.stdout[-3000:]

    (tmp_path / "launch" / "train.yaml").write_text("steps: 20\n")
    third = playbook(tmp_path, "-i", "inventory.yml", "job.yml")
    assert third.returncode == 0 and recap(third.stdout)["changed"] == 1, third.stdout[-3000:]
    assert (staged / "train.yaml").read_text() == "steps: 20\n"
    assert not list(controller_tmp.iterdir())  # each run removed its archive
