"""`gpuprov status DIR`: the training job `up` started, its progress, and the plan beside it."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import yaml

from gpuprov import job, job_status
from gpuprov.bringup import read_state
from gpuprov.commands.up import _load
from gpuprov.errors import GpuprovError
from gpuprov.job import FIRST_NODE, INVENTORY
from gpuprov.job_status import SEPARATOR, TAIL_BYTES, read_tail
from gpuprov.specfile import read_text


def _job_query(kind: str, job_id: str) -> str:
    return job.query_command(kind, job_id)


def _local(kind: str, job_id: str, metrics: Path) -> tuple[str, str]:
    proc = subprocess.run(["sh", "-c", _job_query(kind, job_id)], capture_output=True, text=True, timeout=60)
    return proc.stdout, read_tail(metrics)


def _remote(root: Path, kind: str, job_id: str, metrics: Path) -> tuple[str, str]:
    tool = shutil.which("ansible") or shutil.which("ansible", path=str(Path(sys.executable).parent))
    if tool is None:
        raise GpuprovError("ansible not found on PATH (pip install ansible-core), or run status on the first node with --local")
    script = f"{_job_query(kind, job_id)}; echo {SEPARATOR}; tail -c {TAIL_BYTES} {shlex.quote(str(metrics))} 2>/dev/null || true"
    proc = subprocess.run([tool, FIRST_NODE, "-i", INVENTORY, "-m", "ansible.builtin.shell", "-a", script],
                          cwd=root / "ansible", capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise GpuprovError(f"cannot reach the first node: {(proc.stdout + proc.stderr).strip().splitlines()[-1:]}")
    body = proc.stdout.split(">>", 1)[-1]
    job_text, _, metrics_text = body.partition(SEPARATOR)
    return job_text, metrics_text


@click.command()
@click.argument("directory", metavar="DIR")
@click.option("--job", "job_id", help="Job id (Slurm) or process id to report (default: the one `up` started)")
@click.option("--local", is_flag=True, help="Query this machine (a node of the cluster) instead of the first node over Ansible")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object")
def status(directory: str, job_id: str | None, local: bool, as_json: bool) -> None:
    """The training job's state, step, loss, tokens/s and MFU, beside what the plan predicted.

    \b
    gpuprov status infra/
    gpuprov status infra/ --json
    gpuprov status /shared/jobs/RUN --local   (on a node: scontrol and the metrics file here)
    """
    root, plan = _load(directory)
    recorded = read_state(root).get("job") or {}
    job_id = job_id or recorded.get("id")
    kind = job.job_kind(plan)
    if not job_id or kind is None:
        raise GpuprovError(f"no training job recorded in {root}: `gpuprov up {shlex.quote(str(directory))}` "
                           "submits it (or pass --job ID)")
    if not str(job_id).isdigit():
        raise GpuprovError(f"--job {job_id!r}: expected a number")
    config = yaml.safe_load(read_text(root / "launch" / "train.yaml"))
    metrics = Path(config["logging"]["metrics_file"])
    job_text, metrics_text = _local(kind, job_id, metrics) if local else _remote(root, kind, job_id, metrics)
    result = job_status.report(plan, str(job_id), kind, job_status.job_summary(kind, job_text),
                               job_status.parse_metrics(metrics_text))
    # the job log sits beside the metrics file (both in the run's log folder)
    result["log"] = str(metrics.parent / Path(job.log_file(plan, str(job_id))).name)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    for line in job_status.lines(result):
        click.echo(line)
    click.echo(f"log: {result['log']}")
