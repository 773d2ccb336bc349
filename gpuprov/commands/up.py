"""`gpuprov up DIR [--dry-run]`: bring a bundle's cluster up, step by step, resumable."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import click

from gpuprov import bundle
from gpuprov.bringup import bring_up, tear_down
from gpuprov.errors import GpuprovError
from gpuprov.release import release
from gpuprov.safefile import check_bundle_tree, read_text


def _load(directory: str):
    """(bundle root, its plan); notes hand edits on stderr."""
    root = Path(directory)
    if not root.is_dir():
        raise GpuprovError(f"{root}: no such bundle directory")
    lock = bundle.read_lock(root)
    # terraform and ansible would follow a symlink or hang on a FIFO
    check_bundle_tree(root, [*lock["files"], bundle.LOCK_NAME])
    edited = bundle.edited_files(root, lock)
    if edited:
        click.echo(f"note: {len(edited)} file(s) changed since `gpuprov generate` ({', '.join(edited[:3])}"
                   f"{', ...' if len(edited) > 3 else ''}); `gpuprov check {shlex.quote(str(directory))}` shows how", err=True)
    if not os.path.lexists(root / bundle.PLAN_NAME):
        raise GpuprovError(f"{root / bundle.PLAN_NAME} is missing: regenerate the bundle")
    try:
        plan = bundle.parse_plan(read_text(root / bundle.PLAN_NAME, what="plan"))
    except ValueError as exc:
        raise GpuprovError(f"{root / bundle.PLAN_NAME} does not load: {str(exc).splitlines()[0]}") from None
    return root, plan


@click.command()
@click.argument("directory", metavar="DIR")
@click.option("--dry-run", is_flag=True, help="Print every command, in order, and run nothing")
@click.option("--restart", is_flag=True, help="Ignore the progress of an earlier run and start from the first step")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: print the steps as one JSON object "
              "(README: JSON output)")
def up(directory: str, dry_run: bool, restart: bool, as_json: bool) -> None:
    """Create the cluster (terraform), configure it (ansible), health-check it, print the training command.

    Re-running continues at the step that failed (progress in DIR/.gpuprov-up.json).

    \b
    gpuprov up infra/ --dry-run
    gpuprov up infra/ --dry-run --json
    gpuprov up infra/
    """
    if as_json and not dry_run:
        raise GpuprovError("--json reports the steps `up` would run: add --dry-run (a real run streams the tools' "
                           "own output)")
    root, plan = _load(directory)
    if as_json:
        import json

        from gpuprov.bringup import dry_run_report

        click.echo(json.dumps(dry_run_report(root, plan), indent=2))
        return
    if not dry_run:
        _generated_ansible_cfg(root, plan)
    bring_up(root, plan, dry_run=dry_run, restart=restart, echo=lambda line: click.echo(line))


def _generated_ansible_cfg(root: Path, plan) -> None:
    """`up` runs Ansible in ansible/, where ansible.cfg configures the controller (vault password
    programs, plugin and callback paths): only the one gpuprov generates for this plan is used."""
    from gpuprov.render.ansible import render_ansible

    cfg = root / "ansible" / "ansible.cfg"
    if not os.path.lexists(cfg):
        return
    if read_text(cfg, what="ansible.cfg") != render_ansible(plan)["ansible.cfg"]:
        raise GpuprovError(f"{cfg} is not the one gpuprov generates for this plan; it configures the Ansible "
                           f"that `up` runs here: `gpuprov check {shlex.quote(str(root))}` shows the difference, "
                           f"`gpuprov generate -f {shlex.quote(str(root / bundle.LOCK_NAME))} -o "
                           f"{shlex.quote(str(root))} --force` restores it")


@click.command()
@click.argument("directory", metavar="DIR")
@click.option("--dry-run", is_flag=True, help="Print the destroy command and run nothing")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation")
def down(directory: str, dry_run: bool, yes: bool) -> None:
    """Destroy the cluster of a bundle: terraform destroy, with the arguments `up` used. On-prem the
    hosts stay: the training job is cancelled and the Slurm daemons the bundle started are stopped.

    \b
    gpuprov down infra/ --dry-run
    gpuprov down infra/ --yes
    """
    root, plan = _load(directory)
    onprem = plan.cluster.cloud == "onprem"
    if not dry_run and not yes:
        if not sys.stdin.isatty():  # a pipeline cannot answer: say what it needs instead of a dead prompt
            raise GpuprovError(f"down asks before it {'stops anything' if onprem else 'destroys'} and stdin is not a "
                               f"terminal: pass --yes (gpuprov down {shlex.quote(str(directory))} --yes)")
        question = (f"Stop the training job and the Slurm daemons of {root} on its {plan.cluster.nodes} hosts?"
                    if onprem else
                    f"Destroy every resource of {root} ({plan.cluster.nodes} x {plan.cluster.instance_type})?")
        if not click.confirm(question):
            click.echo("nothing stopped" if onprem else "nothing destroyed", err=True)
            raise SystemExit(1)
    if onprem:
        release(root, plan, dry_run=dry_run, echo=lambda line: click.echo(line))
    else:
        tear_down(root, plan, dry_run=dry_run, echo=lambda line: click.echo(line))
