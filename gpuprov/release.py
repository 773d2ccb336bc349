"""`gpuprov down` on-prem: the hosts are the owner's and stay; what the bundle started on them stops.

A cloud bundle's `down` destroys the nodes and everything on them with them. On the owner's hosts
nothing is destroyed, so `down` ends what `up` left running: the training job it submitted (the
GPUs are free again) and, where the bundle installed Slurm (plan.scheduler.kind "slurm"), the
slurmctld and slurmd it enabled (stopped and disabled: a reboot does not start them again). The
packages, the munge key, the site's shared filesystem and the checkpoints on it stay; a later `up`
starts from the first step and enables Slurm again. A site Slurm (`slurm: existing`) is not ours:
only the job is cancelled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from gpuprov import job
from gpuprov.bringup import INVENTORY, Step, StepFailed, display, read_state, run_step
from gpuprov.bundle import UP_STATE_NAME

# each Slurm daemon the role enables, where the host has its unit (slurmctld on the controller only)
STOP_SLURM = ("for unit in slurmctld slurmd; do systemctl cat $unit.service >/dev/null 2>&1 || continue; "
              "systemctl disable --now $unit.service || exit 1; done")


def recorded_job(root: Path) -> str | None:
    """The job id an earlier `up` recorded (None: none was submitted)."""
    recorded = read_state(root).get("job")
    job_id = str(recorded.get("id", "")) if isinstance(recorded, dict) else ""
    return job_id if job_id.isdigit() else None


def release_steps(root: Path, plan: Any) -> list[Step]:
    """The steps of an on-prem `down`, in order (none: nothing of the bundle was started)."""
    ansible, steps = root / "ansible", []
    job_id = recorded_job(root)
    argv = job.cancel_argv(plan, job_id) if job_id else None
    if job_id and argv:
        what = f"Slurm job {job_id}" if job.job_kind(plan) == "slurm" else f"train.sh, process {job_id}"
        steps.append(Step("cancel-job", f"end the training job ({what}) and wait until none of it runs", argv,
                          ansible, f"on the first node: {job.query_command(job.job_kind(plan) or 'direct', job_id)}"))
    if plan.scheduler.kind == "slurm":
        steps.append(Step("stop-slurm", "stop and disable the Slurm daemons the bundle started (slurmctld, slurmd)",
                          ["ansible", "gpu_nodes", "-i", INVENTORY, "--become", "-m", "ansible.builtin.shell",
                           "-a", STOP_SLURM], ansible,
                          "on the host named above: systemctl status slurmd slurmctld"))
    return steps


def release(root: Path, plan: Any, *, dry_run: bool = False, echo: Callable[[str], None] = print) -> None:
    """Run release_steps; the up state is dropped once they passed (a later `up` starts over)."""
    steps = release_steps(root, plan)
    if dry_run:
        for number, step in enumerate(steps, start=1):
            echo(f"{number}. {display(step, root)}")
        return
    for number, step in enumerate(steps, start=1):
        echo(f"[{number}/{len(steps)}] {step.title}")
        echo(f"  $ {display(step, root)}")
        code = run_step(root, step, echo)
        if code != 0:
            raise StepFailed(f"'{step.name}' failed (exit {code}). Next: {step.hint}; then re-run `gpuprov down`")
    (root / UP_STATE_NAME).unlink(missing_ok=True)
    kept = "; Slurm's packages and the munge key" if plan.scheduler.kind == "slurm" else ""
    echo(f"on-prem: nothing of this bundle runs on the hosts any more; the hosts{kept} and the files on the "
         "shared filesystem (checkpoints, logs) stay")
