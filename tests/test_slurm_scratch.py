"""The Slurm tests' scratch folder: the daemons' users (munge, slurm) must be able to enter it, also on
a machine whose /var/tmp, /tmp and /dev/shm are all root's alone."""

from __future__ import annotations

import shutil
import stat
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import slurm_cluster  # noqa: E402


@pytest.fixture()
def open_parent():
    # a folder others may enter, wherever this machine has one (the function under test finds it)
    parent = Path(tempfile.mkdtemp(prefix="gpuprov-scratch-test-", dir=slurm_cluster.scratch_base()))
    parent.chmod(0o755)
    yield parent
    shutil.rmtree(parent, ignore_errors=True)


def _private(path: Path) -> Path:
    path.mkdir(mode=0o700)
    path.chmod(0o700)
    return path


def test_an_open_system_folder_is_used_as_it_is(open_parent):
    base = slurm_cluster.scratch_base(system=(_private(open_parent / "private"), open_parent),
                                      own=open_parent / "own")
    assert base == open_parent
    assert not (open_parent / "own").exists()


def test_all_private_system_folders_fall_back_to_our_own_sticky_one(open_parent):
    own = open_parent / "own"
    base = slurm_cluster.scratch_base(system=(_private(open_parent / "a"), _private(open_parent / "b")), own=own)
    assert base == own
    mode = own.stat().st_mode
    assert stat.S_IMODE(mode) == 0o1777


def test_our_own_folder_under_a_private_parent_is_refused(open_parent):
    hidden = _private(open_parent / "hidden")
    with pytest.raises(RuntimeError, match="private parent"):
        slurm_cluster.scratch_base(system=(hidden,), own=hidden / "own")
