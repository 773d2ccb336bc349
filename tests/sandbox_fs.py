"""Run a command where the bundle's absolute cluster paths (/scratch, /shared, ...) are test folders.

A bundle's scripts write to the folders the plan decided (train.yaml's checkpoint.dir, the staged
weights and data). To run them unchanged on this machine, the command runs in its own mount
namespace (`unshare`), chrooted into a tmpfs that holds a bind mount of every top-level entry of /
plus the bundle's roots bound to folders of the test. Only the filesystem under the paths is
swapped: the files the bundle wrote are not edited, and nothing outside the namespace changes.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

_SETUP = r"""
set -eu
new="$1"; shift
mount -t tmpfs gpuprov-sandbox "$new"
for entry in /*; do
    name="${entry#/}"
    if [ -L "$entry" ]; then cp -P "$entry" "$new/$name"
    elif [ -d "$entry" ]; then mkdir "$new/$name"; mount --rbind "$entry" "$new/$name"
    fi
done
while [ "$1" != -- ]; do
    target="$1"; source="$2"; shift 2
    mkdir -p "$new$target"
    mount --bind "$source" "$new$target"
done
shift
cwd="$1"; shift
exec chroot "$new" /bin/sh -c 'cd "$0" && exec "$@"' "$cwd" "$@"
"""


def _unshare() -> list[str] | None:
    """The unshare command that gives a mount namespace here: as a user namespace's root (any user where
    they are allowed), else as root itself; None: neither works."""
    if shutil.which("unshare") is None or shutil.which("chroot") is None:
        return None
    for argv in (["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"],
                 ["unshare", "--mount", "--propagation", "private"]):
        if subprocess.run([*argv, "true"], capture_output=True).returncode == 0:
            return argv
    return None


def available() -> str | None:
    """Why the sandbox cannot run here (None: it can)."""
    return None if _unshare() is not None else "unshare/chroot missing, or mount namespaces not allowed here"


def sandboxed(argv: list[str], binds: dict[str, Path], cwd: Path, scratch: Path) -> list[str]:
    """argv run with each absolute path of `binds` (e.g. "/scratch") backed by its test folder;
    `scratch` is an empty folder of the test that holds the namespace's root."""
    for target in binds:
        if not target.startswith("/") or target.count("/") != 1:
            raise ValueError(f"{target!r}: a top-level folder such as /scratch")
    unshare = _unshare()
    if unshare is None:
        raise RuntimeError(available())
    pairs = [part for target, source in binds.items() for part in (target, str(source))]
    return [*unshare, "sh", "-c", _SETUP, "sandbox", str(scratch), *pairs, "--", str(cwd), *argv]
