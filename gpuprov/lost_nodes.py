"""Nodes the cloud no longer runs (a reclaimed spot node, a failed host), found when `up` runs on a
cluster an earlier run created, and handed to Terraform to replace under their names.

`up` reads the node names and instance ids Terraform recorded (`terraform output -json`: the state,
no refresh), asks the cloud's CLI which of them still run (Target.node_states_argv), and writes the
lost names to terraform/replaced_nodes.auto.tfvars.json (Target.replacement_vars), which Terraform
loads by itself. The steps from `terraform plan` on then run again: each lost node gets an instance
of its own under its name and no other node is touched; the inventory takes the new addresses; the
play renders them into slurm.conf on every node (slurmctld on the first node starts from its state
on the shared filesystem); the job an earlier run submitted, requeued by Slurm, is not submitted
again and resumes from its newest checkpoint once its nodes answer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable

from gpuprov.errors import GpuprovError
from gpuprov.safefile import read_text, write_atomic
from gpuprov.targets import get_target

REPLACED_VARS = "replaced_nodes.auto.tfvars.json"
OUTPUT_ARGV = ["terraform", "output", "-no-color", "-json"]
CLI_TIMEOUT_S = 120


def recorded_values(answer: str) -> dict[str, Any]:
    """{output name: value} from `terraform output -json` ({}: not that shape)."""
    try:
        outputs = json.loads(answer)
    except ValueError:
        return {}
    if not isinstance(outputs, dict):
        return {}
    return {k: v["value"] for k, v in outputs.items() if isinstance(v, dict) and "value" in v}


def recorded_nodes(answer: str) -> dict[str, str]:
    """{node name: instance id} from `terraform output -json` ({}: it records no nodes)."""
    try:
        outputs = json.loads(answer)
        names, ids = outputs["node_names"]["value"], outputs["instance_ids"]["value"]
    except (ValueError, KeyError, TypeError):
        return {}
    if not isinstance(names, list) or not isinstance(ids, list) or len(names) != len(ids):
        return {}
    return {n: i for n, i in zip(names, ids) if isinstance(n, str) and isinstance(i, str) and i}


def looks_for_lost(plan) -> bool:
    """Whether `up` asks this bundle's cloud for lost nodes."""
    return get_target(plan.cluster.cloud).replaces_lost_nodes


def _ask(argv: list[str]) -> tuple[str, str | None]:
    """(the CLI's stdout, why it gave no answer: None when it did)."""
    tool = shutil.which(argv[0])
    if tool is None:
        return "", f"{argv[0]} is not on PATH"
    try:
        proc = subprocess.run([tool, *argv[1:]], capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return "", f"no answer in {CLI_TIMEOUT_S} s"
    if proc.returncode != 0:
        return "", (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:200]
    return proc.stdout, None


def find_lost(root: Path, plan, echo: Callable[[str], None]) -> list[str]:
    """Names of the recorded nodes whose instances the cloud no longer runs ([]: none, or it could
    not be asked: a note says why and `up` goes on with the nodes it has)."""
    from gpuprov.bringup import Step, StepFailed, run_terraform
    from gpuprov.preflight import settings

    step = Step("recorded-nodes", "the nodes Terraform recorded", OUTPUT_ARGV, root / "terraform", "", "inventory")
    try:
        code, recorded = run_terraform(step, echo)
    except StepFailed as exc:  # no terraform here: the steps still to run say so if they need it
        echo(f"note: nodes the cloud lost are not looked for this time ({exc})")
        return []
    nodes = recorded_nodes(recorded) if code == 0 else {}
    if code != 0:
        echo("note: `terraform output -json` failed (above): nodes the cloud lost are not looked for this time")
    elif recorded.strip() == "{}":
        forget_replaced(root)  # Terraform records nothing (destroyed): the next apply launches every node
    target = get_target(plan.cluster.cloud)
    s = {**settings(plan, root), "outputs": recorded_values(recorded)} if nodes else {}
    argv = target.node_states_argv(s, nodes) if nodes else None
    if argv is None:
        return []
    answer, why = _ask(argv)
    lost: set[str] = set()
    if why is None:
        try:
            lost = set(target.lost_nodes(nodes, answer))
        except GpuprovError as exc:
            why = str(exc)
    if why is not None:
        echo(f"note: could not ask {target.title} which nodes still run ({why}); going on with the nodes "
             f"recorded. Check by hand: {' '.join(argv[:3])} ...")
        return []
    return [name for name in nodes if name in lost]


def forget_replaced(root: Path) -> None:
    """Drop the list of replaced nodes once the cluster is gone (`down`): a new fleet launches every
    node, and a listed name would get a second instance."""
    (root / "terraform" / REPLACED_VARS).unlink(missing_ok=True)


def _earlier(path: Path) -> dict[str, Any]:
    if not os.path.lexists(path):
        return {}
    try:
        value = json.loads(read_text(path, limit=1 << 20, what="replaced nodes file"))
    except ValueError:
        raise GpuprovError(f"{path} is not JSON: delete it and re-run `gpuprov up`") from None
    return value if isinstance(value, dict) else {}


def mark_replaced(root: Path, plan, names: list[str]) -> Path | None:
    """Write `names` (with those an earlier run replaced under the same request) to
    terraform/replaced_nodes.auto.tfvars.json; returns the file (None: the cloud's Terraform needs
    no list, it recreates a VM it no longer finds)."""
    from gpuprov.preflight import settings

    path = root / "terraform" / REPLACED_VARS
    value = get_target(plan.cluster.cloud).replacement_vars(names, settings(plan, root), _earlier(path))
    if not value:
        return None
    write_atomic(path, json.dumps(value, indent=2, sort_keys=True) + "\n")
    return path


def replace_lost(root: Path, plan, echo: Callable[[str], None]) -> list[str]:
    """Find the lost nodes and list them for Terraform; the names ([]: every node runs)."""
    lost = find_lost(root, plan, echo)
    if lost:
        path = mark_replaced(root, plan, lost)
        if get_target(plan.cluster.cloud).keeps_node_names:
            how = f"listed in {path.relative_to(root).as_posix()}" if path else "Terraform recreates them"
            what = f"replacing each under its name ({how})"
        else:
            what = "Terraform restores the node count, each new node under a new name"
        echo(f"lost {len(lost)} node(s) the cloud no longer runs: {', '.join(lost)}; {what}, then configuring "
             "them and resuming the job")
    return lost
