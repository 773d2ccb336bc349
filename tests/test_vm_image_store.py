"""tests/vm/build_image.sh's machine store: a checkout's image is kept by its recipe's hash, a fresh checkout
copies it instead of building, and a stale or foreign copy is never used (the build runs instead)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "vm" / "build_image.sh"
FILES = ("root.img", "vmlinuz", "initrd.img")


def _hash(extra: str = "") -> str:
    return hashlib.sha256(SCRIPT.read_bytes() + f"{extra}\n".encode()).hexdigest()


def _image(folder: Path, stamp: str) -> None:
    folder.mkdir(parents=True)
    for name in FILES:
        (folder / name).write_text(f"{name} of {folder.name}\n")
    (folder / "stamp").write_text(f"{stamp}\n")


def _tried_to_build(tmp_path: Path, result: subprocess.CompletedProcess[str]) -> bool:
    """The script went on to build: it ran debootstrap, or (not root) stopped where a build needs root."""
    return (tmp_path / "built").exists() if os.geteuid() == 0 else "debootstrap needs root" in result.stderr


@pytest.fixture()
def run(tmp_path):
    """build_image.sh with VM_CACHE and VM_IMAGE_STORE under tmp_path; a debootstrap stub that records
    being asked (a build) and fails, so no test here builds anything."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "debootstrap").write_text(f"#!/bin/sh\ntouch {tmp_path}/built\nexit 1\n")
    (stubs / "debootstrap").chmod(0o755)

    def go(cache: str, extra: str = "") -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "VM_CACHE": str(tmp_path / cache), "VM_IMAGE_STORE": str(tmp_path / "store"),
               "VM_EXTRA_PACKAGES": extra, "PATH": f"{stubs}:{os.environ['PATH']}"}
        return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)
    return go


def test_a_built_image_is_stored_and_a_fresh_checkout_copies_it(tmp_path, run):
    _image(tmp_path / "first", _hash())
    assert run("first").returncode == 0
    stored = tmp_path / "store" / _hash()
    assert sorted(p.name for p in stored.iterdir()) == sorted([*FILES, "stamp"])
    second = run("second")
    assert second.returncode == 0, second.stderr
    assert not (tmp_path / "built").exists()
    for name in FILES:
        assert (tmp_path / "second" / name).read_text() == f"{name} of first\n"
    assert (tmp_path / "second" / "stamp").read_text().strip() == _hash()


def test_a_stale_stored_image_is_built_again_not_copied(tmp_path, run):
    _image(tmp_path / "store" / _hash(), _hash())
    old = time.time() - 10 * 86400  # past the default 7 days
    os.utime(tmp_path / "store" / _hash() / "stamp", (old, old))
    result = run("checkout")
    assert result.returncode != 0 and _tried_to_build(tmp_path, result)
    assert not (tmp_path / "checkout" / "root.img").exists()


def test_another_recipe_never_takes_the_stored_image(tmp_path, run):
    _image(tmp_path / "store" / _hash(), _hash())  # the plain image; the rehearsal's adds packages
    result = run("checkout", extra="slurm-wlm,munge")
    assert result.returncode != 0 and _tried_to_build(tmp_path, result)
    assert not (tmp_path / "checkout" / "root.img").exists()
