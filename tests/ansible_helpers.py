"""Shared helpers for the Ansible tests: write a rendered bundle, run the real ansible-playbook
and ansible-lint from this Python's environment against localhost (connection local)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ANSIBLE_PLAYBOOK = BIN / "ansible-playbook"
ANSIBLE_LINT = BIN / "ansible-lint"

LOCAL_INVENTORY = {
    "all": {"children": {"gpu_nodes": {"hosts": {"node0": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}}
}


@contextlib.contextmanager
def private_dir(prefix: str):
    """A temporary folder outside /tmp/pytest-of-<user>: pytest sessions of other users of this
    machine prune that shared base (keeping 3), which deleted folders under running playbooks."""
    with tempfile.TemporaryDirectory(prefix=f"gpuprov-{prefix}-") as name:
        yield Path(name)


def write_files(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def write_local_inventory(root: Path) -> Path:
    path = root / "local-inventory.yml"
    path.write_text(json.dumps(LOCAL_INVENTORY))
    return path


def ansible_env(scratch: Path) -> dict[str, str]:
    return dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0", ANSIBLE_HOME=str(scratch),
                ANSIBLE_LOCAL_TEMP=str(scratch / "tmp"), ANSIBLE_RETRY_FILES_ENABLED="0",
                ANSIBLE_DEPRECATION_WARNINGS="0", PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")


def playbook(cwd: Path, *args: str, extra_vars: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [str(ANSIBLE_PLAYBOOK), *args]
    if extra_vars:
        cmd += ["-e", json.dumps(extra_vars)]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=ansible_env(cwd / ".ansible-scratch"))
    proc.stdout += proc.stderr
    return proc


def recap(output: str, host: str = "node0") -> dict[str, int]:
    match = re.search(rf"^{re.escape(host)}\s*:\s*(.*)$", output, re.MULTILINE)
    assert match, f"no PLAY RECAP line for {host}:\n{output[-3000:]}"
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", match.group(1))}


@functools.lru_cache(maxsize=1)
def os_id() -> str:
    """This machine's OS as the roles name it: <distribution>-<distribution_version> from Ansible's facts."""
    proc = subprocess.run([str(BIN / "ansible"), "localhost", "-c", "local", "-m", "ansible.builtin.setup",
                           "-a", "filter=ansible_distribution*", "-e", f"ansible_python_interpreter={sys.executable}"],
                          capture_output=True, text=True, timeout=120, env=ansible_env(Path("/tmp/gpuprov-facts")))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    facts = json.loads(proc.stdout[proc.stdout.index("{"):])["ansible_facts"]
    return f"{facts['ansible_distribution'].lower()}-{facts['ansible_distribution_version']}"


def has_nvidia_gpu() -> bool:
    for dev in Path("/sys/bus/pci/devices").glob("*"):
        try:
            if (dev / "vendor").read_text().strip() == "0x10de" and \
                    (dev / "class").read_text().strip().startswith(("0x0300", "0x0302")):
                return True
        except OSError:
            continue
    return False
