"""The bundle as a tar stream (`generate -o -`): deterministic bytes, so GitOps diffs show only real changes.

Sorted entries, mtime 0, root ownership and the bundle's fixed modes (bundle.file_mode).
"""

from __future__ import annotations

import io
import tarfile
from pathlib import PurePosixPath
from typing import Any

from gpuprov.bundle import TAR_PREFIX, file_mode


def tar_bytes(files: dict[str, str], prefix: str = TAR_PREFIX) -> bytes:
    """The bundle as a deterministic tar: sorted entries, mtime 0, uid/gid 0, fixed modes."""
    buffer = io.BytesIO()
    write_tar(files, buffer, prefix)
    return buffer.getvalue()


def write_tar(files: dict[str, str], stream: Any, prefix: str = TAR_PREFIX) -> None:
    directories = {prefix} | {f"{prefix}/{p}" for path in files for p in PurePosixPath(path).parents if str(p) != "."}
    entries = sorted([(d, None) for d in directories] + [(f"{prefix}/{p}", t) for p, t in files.items()])
    with tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for name, text in entries:
            info = tarfile.TarInfo(name)
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if text is None:
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tar.addfile(info)
            else:
                data = text.encode("utf-8")
                info.size = len(data)
                info.mode = file_mode(name)
                tar.addfile(info, io.BytesIO(data))
