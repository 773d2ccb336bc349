"""The user's cache folder: `$XDG_CACHE_HOME/gpuprov` (`~/.cache/gpuprov`), for work a later run can reuse.

Only derived data lives there (compiled templates), each entry keyed by a hash of everything it was
derived from, so an entry is either exactly what this run would compute or it is not found. Deleting
the folder is always safe; `GPUPROV_NO_CACHE=1` turns it off; a folder that cannot be created or
written (a read-only home, a full disk) means no cache, never a failed command.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def cache_dir(kind: str) -> Path | None:
    """`<cache>/gpuprov/<kind>`, created private to this user; None when off or not usable."""
    if os.environ.get("GPUPROV_NO_CACHE", "") not in ("", "0"):
        return None
    base = os.environ.get("XDG_CACHE_HOME", "")
    try:
        root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
        path = root / "gpuprov" / kind
        path.mkdir(mode=stat.S_IRWXU, parents=True, exist_ok=True)
        st = os.lstat(path)
    except (OSError, RuntimeError):  # RuntimeError: no home directory to expand
        return None
    # a folder another user owns, or a link, could hand this run someone else's code
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None
    return path


def write_atomic(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all (a reader never sees half an entry); a failed write is no error."""
    import tempfile

    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass


def code_hash(*files: str | Path) -> str:
    """A hash of source files: a cached result is keyed by the code that computed it."""
    import hashlib

    digest = hashlib.sha256()
    for f in files:
        digest.update(Path(f).read_bytes())
    return digest.hexdigest()[:32]


class IntMemo:
    """A persistent table key -> int for one pure function, in one file per version of the code that computes it
    (`<cache>/gpuprov/<kind>/<code hash>.json`); read once per process, and rewritten whole once, when the process
    exits, if it found new results (a plan's search finds a dozen: one write instead of a dozen)."""

    def __init__(self, kind: str, *sources: str | Path) -> None:
        self.kind, self.sources = kind, sources
        self._path: Path | None = None
        self._table: dict[str, int] | None = None
        self._dirty = False

    def _load(self) -> dict[str, int]:
        if self._table is None:
            import json

            self._table = {}
            folder = cache_dir(self.kind)
            if folder is not None:
                self._path = folder / f"{code_hash(*self.sources)}.json"
                try:
                    found = json.loads(self._path.read_bytes())
                    if isinstance(found, dict):
                        self._table = {k: v for k, v in found.items() if type(v) is int}
                except (OSError, ValueError):
                    pass
        return self._table

    def get(self, key: str) -> int | None:
        return self._load().get(key)

    def put(self, key: str, value: int) -> None:
        self._load()[key] = value
        if self._path is not None and not self._dirty:
            import atexit

            self._dirty = True
            atexit.register(self.flush)

    def flush(self) -> None:
        """Write the table now if it has results the file lacks (also run at exit)."""
        if self._dirty and self._path is not None and self._table is not None:
            import json

            self._dirty = False
            write_atomic(self._path, json.dumps(self._table, sort_keys=True).encode())
