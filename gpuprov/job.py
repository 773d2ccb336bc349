"""The training job of a bundle: how `up` starts it (its last step) and what `status` reads back.

Multi-node plans with a scheduler submit launch/slurm.sbatch on the first node (Slurm requeues it
when a node fails); a single node without one starts launch/train.sh there in the background.
Either way the job's files were staged by site.yml (tag job) at the paths launch/train.yaml uses.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

FIRST_NODE = "gpu_nodes[0]"
INVENTORY = "inventory.yml"


def job_kind(plan: Any) -> str | None:
    """slurm: sbatch on the first node; direct: train.sh on the only node; None: started by hand."""
    if plan.scheduler.kind in ("slurm", "existing"):
        return "slurm"
    return "direct" if plan.cluster.nodes == 1 else None


def _paths(plan: Any) -> dict[str, str]:
    from gpuprov.render.launch import run_paths

    return run_paths(plan)


def log_file(plan: Any, job_id: str | None) -> str:
    p = _paths(plan)
    if job_kind(plan) == "slurm":
        return f"{p['log_dir']}/{p['run_id']}-{job_id or '<job id>'}.out"  # sbatch --output=%x-%j.out
    return f"{p['log_dir']}/train.log"


def submit_argv(plan: Any) -> list[str] | None:
    """The ad-hoc Ansible command that starts the job on the first node (None: no automatic start)."""
    kind = job_kind(plan)
    launch = f"{_paths(plan)['job_dir']}/launch"
    if kind == "slurm":
        return ["ansible", FIRST_NODE, "-i", INVENTORY, "-m", "ansible.builtin.command",
                "-a", f"sbatch --parsable slurm.sbatch chdir={launch}"]
    if kind == "direct":
        # detached from the Ansible session; the pid is printed for `status`
        script = (f"cd {shlex.quote(launch)} && setsid nohup ./train.sh >> {shlex.quote(log_file(plan, None))} "
                  "2>&1 < /dev/null & echo $!")
        return ["ansible", FIRST_NODE, "-i", INVENTORY, "-m", "ansible.builtin.shell", "-a", script]
    return None


# Slurm job states in which the job still holds or waits for nodes (squeue(1) JOB STATE CODES): `up`
# submits no second job while the recorded one is in one of them
ACTIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD",
                           "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "SUSPENDED", "STOPPED",
                           "RESV_DEL_HOLD", "SPECIAL_EXIT"})


def query_command(kind: str, job_id: str) -> str:
    """Shell command printing the job's scheduler record (slurm) or whether the process lives (direct)."""
    if kind == "slurm":
        return f"scontrol show job --oneliner {shlex.quote(job_id)} 2>&1"
    return f"ps -o pid= -p {shlex.quote(job_id)} || echo exited"


def query_argv(plan: Any, job_id: str) -> list[str]:
    """The ad-hoc Ansible command that runs query_command on the first node."""
    return ["ansible", FIRST_NODE, "-i", INVENTORY, "-m", "ansible.builtin.shell",
            "-a", query_command(job_kind(plan) or "direct", job_id)]


_ID = re.compile(r"^\s*(\d+)(?:;[\w.-]+)?\s*$", re.M)


def cancel_command(kind: str, job_id: str) -> str:
    """Shell command that ends the job and returns once nothing of it runs (exit 1 after 3 minutes)."""
    quoted = shlex.quote(job_id)
    if kind == "slurm":  # scancel, then wait until slurmctld no longer holds it in an active state
        active = "|".join(sorted(ACTIVE_STATES))
        stop, running = f"scancel {quoted}", (f"scontrol show job --oneliner {quoted} 2>/dev/null "
                                              f"| grep -qE 'JobState=({active}) '")
    else:  # train.sh was started as the leader of its own session (setsid): the session is the job
        stop, running = f"pkill --session {quoted}", f"pgrep --session {quoted} >/dev/null"
    return (f"{stop} 2>&1; for i in $(seq 90); do {running} || exit 0; sleep 2; done; "
            f"echo 'job {job_id} still runs after 180 s' >&2; exit 1")


def cancel_argv(plan: Any, job_id: str) -> list[str] | None:
    """The ad-hoc Ansible command that runs cancel_command on the first node, as the user that submitted it."""
    kind = job_kind(plan)
    if kind is None or not job_id.isdigit():
        return None
    return ["ansible", FIRST_NODE, "-i", INVENTORY, "-m", "ansible.builtin.shell", "-a", cancel_command(kind, job_id)]


def parse_submission(output: str) -> str | None:
    """The job id (sbatch --parsable) or pid a submit step printed, from Ansible's ad-hoc output."""
    body = output.split(">>", 1)[1] if ">>" in output else output
    match = _ID.search(body)
    return match.group(1) if match else None


def submitted_lines(root: Path, plan: Any, job_id: str) -> list[str]:
    quoted = shlex.quote(str(root))
    if job_kind(plan) == "slurm":
        where = f"partition {plan.scheduler.partition}" if plan.scheduler.partition else "the site's default partition"
        return [f"training submitted: Slurm job {job_id} ({plan.cluster.nodes} nodes, {where}); a failed node "
                f"requeues it and it resumes from the newest checkpoint",
                f"  watch: gpuprov status {quoted}   (on the first node: squeue -j {job_id})",
                f"  log:   {log_file(plan, job_id)} (first node)"]
    return [f"training started: train.sh on the node, process {job_id}",
            f"  watch: gpuprov status {quoted}",
            f"  log:   {log_file(plan, job_id)} (on the node)"]
