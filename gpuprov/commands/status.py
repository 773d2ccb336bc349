"""`gpuprov status DIR`: the training job `up` started, its progress, and the plan beside it."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import click
import yaml

from gpuprov import job, job_status, toolenv
from gpuprov.bringup import read_state
from gpuprov.commands.up import _load
from gpuprov.errors import GpuprovError
from gpuprov.job import FIRST_NODE, INVENTORY
from gpuprov.job_status import JOBCOMP_SEPARATOR, SEPARATOR, TAIL_BYTES, read_tail
from gpuprov.safefile import read_text as read_bundle_text
from gpuprov.specfile import MAX_FILE_BYTES, _plain, load_yaml


def _job_query(kind: str, job_id: str, jobcomp: str = "") -> str:
    live = job.query_command(kind, job_id)
    if kind != "slurm" or not jobcomp:  # no records, or the site's Slurm: its records are not the bundle's to read
        return live
    # the completion record outlives slurmctld's memory of the job (MinJobAge)
    return (f"{live}; echo {JOBCOMP_SEPARATOR}; "
            f"grep -F {shlex.quote(f'JobId={job_id} ')} {shlex.quote(jobcomp)} 2>/dev/null | tail -n 1 || true")


def _local(kind: str, job_id: str, metrics: Path, jobcomp: str = "") -> tuple[str, str]:
    proc = subprocess.run(["sh", "-c", _job_query(kind, job_id, jobcomp)], capture_output=True, text=True, timeout=60)
    return proc.stdout, read_tail(metrics)


# the connection variables `up` writes into ansible/inventory.yml (terraform output, on-prem hosts),
# and the two a rehearsal sets to swap the transport (checked below: ssh or local, a plain path)
CONNECTION_VARS = ("ansible_host", "ansible_user", "ansible_port", "ansible_ssh_common_args",
                   "ansible_ssh_private_key_file", "ansible_connection", "ansible_python_interpreter")
_JINJA = re.compile(r"{{|{%|{#")
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9._/+@=,-]{1,4000}")
_WORD = re.compile(r"[A-Za-z0-9_\[][A-Za-z0-9._:%@\[\]-]{0,252}")  # a name, IPv4/IPv6 address, id, user or port


def _inside(root: Path, path: str) -> bool:
    return Path(os.path.realpath(path)).is_relative_to(Path(os.path.realpath(root)))


def _connection_vars(root: Path, where: str, values: Any) -> dict:
    """The connection variables of one inventory level; any other ansible_* setting is refused."""
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise GpuprovError(f"{where}: expected a mapping of variables")
    kept = {}
    for key, value in values.items():
        if not isinstance(key, str) or not key.startswith("ansible_"):
            continue  # role variables: status runs no role
        if key not in CONNECTION_VARS:
            raise GpuprovError(f"{where}: {key} is not a connection setting gpuprov writes "
                               f"({', '.join(CONNECTION_VARS)}); status does not run with it")
        if not isinstance(value, (str, int)) or isinstance(value, bool) or _JINJA.search(str(value)) or "\0" in str(value):
            raise GpuprovError(f"{where}: {key} must be plain text without Jinja markers")
        if key in ("ansible_host", "ansible_user", "ansible_port") and not _WORD.fullmatch(str(value)):
            # ssh reads a leading `-` as an option (-oProxyCommand=...)
            raise GpuprovError(f"{where}: {key} {str(value)[:40]!r} is not a plain host, user or port")
        if key == "ansible_connection" and value not in ("ssh", "local"):
            raise GpuprovError(f"{where}: ansible_connection {str(value)[:40]!r}: status connects over ssh (or local)")
        if key == "ansible_python_interpreter" and (not _PLAIN_PATH.fullmatch(str(value)) or _inside(root, str(value))):
            # Ansible puts it in a shell command line: a plain path of this machine's, none of the bundle's
            raise GpuprovError(f"{where}: ansible_python_interpreter must be a plain absolute path outside the bundle")
        kept[key] = value
    return kept


def _inventory(root: Path) -> dict:
    """The first node's connection, from the inventory `up` wrote: its connection variables only
    (status loads no group_vars, plugin or setting from the bundle)."""
    path = root / "ansible" / INVENTORY
    if not os.path.lexists(path):
        raise GpuprovError(f"{path} is missing: `gpuprov up` writes it (or run status on the first node with --local)")
    data = _plain(load_yaml(path, read_bundle_text(path, limit=MAX_FILE_BYTES, what="inventory")))
    try:
        top = data["all"]
        hosts = top["children"]["gpu_nodes"]["hosts"]
        name, host = next(iter(hosts.items()))
    except (KeyError, TypeError, StopIteration, AttributeError):
        raise GpuprovError(f"{path}: lists no host under all.children.gpu_nodes.hosts") from None
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}", name):
        raise GpuprovError(f"{path}: host name {str(name)[:60]!r} is not a plain host name")
    settings = {**_connection_vars(root, f"{path}: all.vars", top.get("vars")),
                **_connection_vars(root, f"{path}: {name}", host)}
    return {"all": {"children": {"gpu_nodes": {"hosts": {name: settings}}}}}


def _adhoc(plan, inventory: dict, script: str) -> subprocess.CompletedProcess:
    """`ansible gpu_nodes[0] -m shell -a SCRIPT` from a scratch folder: gpuprov's own ansible.cfg
    for this plan (not the bundle's), the given inventory, lookups refused (toolenv)."""
    from gpuprov.render.ansible import render_ansible

    tool = shutil.which("ansible") or shutil.which("ansible", path=str(Path(sys.executable).parent))
    argv = tool and toolenv.ansible_argv(tool, [FIRST_NODE, "-i", INVENTORY, "-m", "ansible.builtin.shell",
                                                "-a", script])
    if not argv:
        raise GpuprovError("ansible not found on PATH (pip install ansible-core), or run status on the first node with --local")
    with tempfile.TemporaryDirectory(prefix="gpuprov-status-") as temp:
        scratch = Path(temp)
        for name in ("home", "tmp"):
            (scratch / name).mkdir()
        (scratch / "ansible.cfg").write_text(render_ansible(plan)["ansible.cfg"])
        (scratch / INVENTORY).write_text(yaml.safe_dump(inventory, default_flow_style=False))
        env = toolenv.ansible_env(scratch, scratch / "ansible.cfg", keep_user=True)
        return subprocess.run(argv, cwd=scratch, capture_output=True, text=True, errors="replace", env=env, timeout=300)


def _remote(root: Path, plan, kind: str, job_id: str, metrics: Path, jobcomp: str = "") -> tuple[str, str]:
    script = f"{_job_query(kind, job_id, jobcomp)}; echo {SEPARATOR}; tail -c {TAIL_BYTES} {shlex.quote(str(metrics))} 2>/dev/null || true"
    proc = _adhoc(plan, _inventory(root), script)
    if proc.returncode != 0:
        raise GpuprovError(f"cannot reach the first node: {(proc.stdout + proc.stderr).strip().splitlines()[-1:]}")
    body = proc.stdout.split(">>", 1)[-1]
    job_text, _, metrics_text = body.partition(SEPARATOR)
    return job_text, metrics_text


def _metrics_file(root: Path) -> Path:
    """logging.metrics_file of launch/train.yaml: a plain absolute path (it reaches a shell line
    Ansible templates, so nothing but path characters)."""
    path = root / "launch" / "train.yaml"
    config = _plain(load_yaml(path, read_bundle_text(path, limit=MAX_FILE_BYTES, what="train config")))
    value = (config.get("logging") or {}).get("metrics_file") if isinstance(config, dict) else None
    if not isinstance(value, str) or not _PLAIN_PATH.fullmatch(value) or ".." in value.split("/"):
        raise GpuprovError(f"{path}: logging.metrics_file must be an absolute path of letters, digits and "
                           f"._/+@=,- (got {str(value)[:80]!r})")
    return Path(value)


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
    metrics = _metrics_file(root)
    jobcomp = plan.scheduler.jobcomp_loc if plan.scheduler.kind == "slurm" else ""
    if jobcomp and (not _PLAIN_PATH.fullmatch(jobcomp) or ".." in jobcomp.split("/")):
        # it reaches a shell line Ansible templates: a plain path, as logging.metrics_file
        raise GpuprovError(f"plan.json: scheduler.jobcomp_loc must be an absolute path of letters, digits and "
                           f"._/+@=,- (got {jobcomp[:80]!r})")
    job_text, metrics_text = (_local(kind, job_id, metrics, jobcomp) if local
                              else _remote(root, plan, kind, job_id, metrics, jobcomp))
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
