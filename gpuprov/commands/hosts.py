"""`gpuprov hosts probe FILE`: fill a hosts file with what each host holds, read over SSH."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import click
from pydantic import ValidationError

from gpuprov.catalog.gpus import list_gpus
from gpuprov.errors import GpuprovError
from gpuprov.probe import PROBE_SCRIPT, parse_probe
from gpuprov.render.escape import shell_word, yaml_flow
from gpuprov.safefile import write_atomic
from gpuprov.spec import HostEntry
from gpuprov.specfile import format_validation_error, hosts_format, load_hosts

MAX_PROBE_CHARS = 1 << 20  # the probe's output is a few KiB, even with 16 NVMe drives and 8 HCAs
FIELDS = ("gpu", "gpus", "power_limit_w", "ram_gib", "cores", "nvme_count", "nvme_gb_each", "fabric", "nic_gbps")


@click.group()
def hosts() -> None:
    """On-prem hosts: read what they hold.

    \b
    gpuprov hosts probe hosts.yaml            # print the filled hosts file
    gpuprov hosts probe hosts.yaml --write    # update it in place
    """


def _ssh(host, script: str, timeout: int) -> str:
    ssh = shutil.which("ssh")
    if ssh is None:
        raise GpuprovError("ssh not found on PATH (install openssh-client)")
    target = f"{host.user}@{host.address}" if host.user else host.address
    port = ["-p", str(host.port)] if host.port else []
    cmd = [ssh, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout}", *port, target, script]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout * 6)
    except subprocess.TimeoutExpired:
        raise GpuprovError(f"{host.name} ({host.address}): no answer over ssh within {timeout * 6} s") from None
    if proc.returncode != 0 and "### nvidia-smi" not in proc.stdout:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise GpuprovError(f"{host.name} ({host.address}): ssh failed (exit {proc.returncode}): {last}")
    if len(proc.stdout) > MAX_PROBE_CHARS:
        raise GpuprovError(f"{host.name} ({host.address}): the probe printed more than {MAX_PROBE_CHARS:,} characters")
    return proc.stdout


def _replace(path: Path, text: str) -> None:
    """A fresh temporary file beside FILE renamed over it (mode kept): an interrupted run leaves the
    old file whole, and no fixed temporary name exists for a planted symlink to redirect."""
    try:
        write_atomic(path, text, mode=None)
    except OSError as exc:
        raise GpuprovError(f"cannot write {path}: {exc.strerror or type(exc).__name__}") from None


def _line(entry: dict) -> str:
    """One host as a YAML flow mapping, every value through the renderers' YAML escaping: a name
    such as `null` or `0777` reads back as that string, and no value can add a key or a host."""
    # keys are this module's own field names (plain YAML words); every value is escaped
    return "- {" + ", ".join(f"{k}: {yaml_flow(v)}" for k, v in entry.items() if v is not None) + "}"


@hosts.command()
@click.argument("hosts_file", metavar="FILE", type=click.Path(dir_okay=False, exists=True))
@click.option("--write", is_flag=True, help="Update FILE (a YAML list or mapping) in place instead of printing it")
@click.option("--timeout", type=click.IntRange(min=1), default=10, show_default=True, help="SSH connect timeout, s")
@click.option("--json", "as_json", is_flag=True, help="Print the hosts as one JSON object (README: JSON output)")
def probe(hosts_file: str, write: bool, timeout: int, as_json: bool) -> None:
    """Read GPUs and their power limit (nvidia-smi), RAM and cores (free, lscpu), NVMe (lsblk) and NICs (ip, ibstat) over SSH.

    \b
    gpuprov hosts probe hosts.yaml
    gpuprov hosts probe hosts.yaml --write && gpuprov plan --model 70b --hosts hosts.yaml
    gpuprov hosts probe hosts.yaml --json
    """
    if write and (kind := hosts_format(hosts_file)) in ("ini", "inventory"):
        # --write replaces the file with a YAML list: an ini file would no longer parse as the .ini it
        # is named, and an Ansible inventory would lose the structure Ansible reads
        raise GpuprovError(f"--write would replace the {'ini lines' if kind == 'ini' else 'Ansible inventory'} "
                           f"in {hosts_file} with a YAML list; print it instead: "
                           f"gpuprov hosts probe {shell_word(hosts_file)} > hosts.yaml")
    catalog = list_gpus()
    lines, found_hosts = [], []
    for h in load_hosts(hosts_file):
        try:
            found = parse_probe(_ssh(h, PROBE_SCRIPT, timeout), catalog)
        except ValueError as exc:
            raise GpuprovError(f"{h.name} ({h.address}): {exc}") from None
        entry = {**h.model_dump(exclude_none=True), **found}
        try:
            HostEntry.model_validate(entry)  # what is written reads back
        except ValidationError as exc:
            raise GpuprovError(f"{h.name} ({h.address}): the probe's figures do not fit a hosts file: "
                               f"{format_validation_error(exc)}") from None
        one = {k: entry.get(k) for k in ("name", "address", "user", "port", *FIELDS)}
        lines.append(_line(one))
        found_hosts.append(one)
    text = "# filled by `gpuprov hosts probe`\n" + "\n".join(lines) + "\n"
    if write:
        _replace(Path(hosts_file), text)
    if as_json:
        click.echo(json.dumps({"file": hosts_file, "written": write, "hosts": found_hosts}, indent=2))
    elif write:
        click.echo(f"wrote {hosts_file} ({len(lines)} hosts)")
    else:
        click.echo(text, nl=False)
