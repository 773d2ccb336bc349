"""What `gpuprov down` runs on an on-prem host to end the bundle's job (gpuprov/job.py cancel_command),
run here in bash against a fake scancel/scontrol pair and a real setsid process tree."""

from __future__ import annotations

import os
import subprocess
import textwrap
import time
from pathlib import Path

from gpuprov.job import cancel_command

# slurmctld's view: RUNNING until scancel, then CANCELLED (scontrol show job --oneliner's format)
FAKE_SLURM = {
    "scancel": 'echo "$1" >> "$FAKE_DIR/cancelled"\n',
    "scontrol": textwrap.dedent("""\
        state=RUNNING
        grep -qx "$4" "$FAKE_DIR/cancelled" 2>/dev/null && state=CANCELLED
        [ -n "$FAKE_STUCK" ] && state=COMPLETING
        echo "JobId=$4 JobName=x JobState=$state Reason=None Dependency=(null)"
        """),
}


def _fake_slurm(tmp_path: Path, **env: str) -> dict[str, str]:
    for name, body in FAKE_SLURM.items():
        (tmp_path / name).write_text("#!/bin/sh\n" + body)
        (tmp_path / name).chmod(0o755)
    return dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", FAKE_DIR=str(tmp_path), **env)


def test_slurm_job_is_cancelled_and_waited_for(tmp_path: Path) -> None:
    run = subprocess.run(["bash", "-c", cancel_command("slurm", "4242")], env=_fake_slurm(tmp_path),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "cancelled").read_text().split() == ["4242"]


def test_a_job_that_never_leaves_the_queue_fails(tmp_path: Path) -> None:
    command = cancel_command("slurm", "7").replace("seq 90", "seq 2").replace("sleep 2", "sleep 0.1")
    run = subprocess.run(["bash", "-c", command], env=_fake_slurm(tmp_path, FAKE_STUCK="1"),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "job 7 still runs" in run.stderr


def test_direct_job_session_is_ended(tmp_path: Path) -> None:
    """train.sh started as `setsid nohup ./train.sh &` (job.submit_argv): it and its children end."""
    started = subprocess.run(["sh", "-c", "setsid sh -c 'sleep 300 & sleep 300' >/dev/null 2>&1 < /dev/null & echo $!"],
                             capture_output=True, text=True, timeout=30)
    pid = started.stdout.strip()
    time.sleep(0.5)
    assert subprocess.run(["pgrep", "--session", pid], capture_output=True).stdout.split()
    run = subprocess.run(["bash", "-c", cancel_command("direct", pid)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert subprocess.run(["pgrep", "--session", pid], capture_output=True).returncode == 1
