"""A finished search kept in the user's cache folder (usercache.py), so the same question asked again is answered
without walking the space again (the walk is most of `gpuprov plan`'s time).

An entry is keyed by a hash of everything the walk reads: the spec (every field), the model's architecture, the
instances offered and the GPUs they carry (as given, after the power limit), the estimator's name and the
walk's switches, plus every gpuprov source file and catalog file (each by its text or, unchanged for two
seconds, by its inode, size and times: hash_tree), gpuprov's version and Python's.
Anything else changed is another key, so an entry is either exactly what this walk would return or it is not
found. The memo serves a command run as a process (`gpuprov ...`, `python -m gpuprov`), switched on by
cli.main: code patched in memory by a library caller or a test is what no file hash can see.
"""

from __future__ import annotations

import os
import sys
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from pathlib import Path

# hashlib and pickle are imported where used: `gpuprov --help` switches the memo on and needs neither

ENABLED = False  # cli.main turns it on for a command run as a process
KEEP = 64  # entries kept; a store beyond that removes the oldest (a plan's few searches each take one)


def enable(on: bool = True) -> None:
    global ENABLED
    ENABLED = on


@lru_cache(maxsize=None)
def code_tag() -> bytes:
    """A hash of the code and data any search runs on: every .py file of the package and every catalog file."""
    import hashlib
    import pickle

    import gpuprov
    from gpuprov.resources import _PACKAGE_DIR

    data = os.path.join(str(_PACKAGE_DIR), "catalog", "data")
    digest = hashlib.sha256(f"{gpuprov.__version__}|{sys.version}|{pickle.HIGHEST_PROTOCOL}".encode())
    hash_tree(digest, str(_PACKAGE_DIR), lambda folder, name: name.endswith(".py") or folder == data
              or folder.startswith(data + os.sep))
    return digest.digest()


# A file changed this recently is keyed by its text, older ones by their metadata (see hash_tree)
RECENT_NS = 2_000_000_000


def hash_tree(digest: Any, root: str, wanted: Callable[[str, str], bool]) -> None:
    """Add to `digest` every file under `root` that `wanted(folder, name)` keeps, in a fixed order (compiled-code
    folders skipped): its relative path and length, then its inode, modification and change times or, for a file
    changed in the last RECENT_NS, its bytes. Any write gives a file a new change time (no user can set one back),
    so metadata tells an edited file from the one hashed before, as Python's own bytecode cache trusts size and
    modification time, without reading 3 MB on every run; only two edits within one tick of the file system's
    clock (milliseconds) can share a change time, and a file that young is read instead (git's "racily clean"
    rule)."""
    import time

    now = time.time_ns()
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")
        for name in sorted(names):
            if not wanted(folder, name):
                continue
            path = os.path.join(folder, name)
            st = os.stat(path)
            digest.update(f"\0{os.path.relpath(path, root)}\0{st.st_size}\0".encode())
            if now - max(st.st_mtime_ns, st.st_ctime_ns) > RECENT_NS:
                digest.update(f"{st.st_ino}\0{st.st_mtime_ns}\0{st.st_ctime_ns}".encode())
                continue
            with open(path, "rb") as handle:
                digest.update(handle.read())


def trim(folder: Path, pattern: str, keep: int) -> None:
    """Keep the newest `keep` - 1 entries matching `pattern` before a new one is written."""
    try:
        entries = sorted(folder.glob(pattern), key=lambda p: p.stat().st_mtime_ns)
        for old in entries[: max(0, len(entries) - (keep - 1))]:
            old.unlink()
    except OSError:
        pass


def _named(fn: Any) -> str | None:
    """`module:qualname` of a gpuprov function that is what its module holds under that name; else None."""
    module, qualname = getattr(fn, "__module__", None) or "", getattr(fn, "__qualname__", "")
    if not module.startswith("gpuprov.") or "<" in qualname:
        return None
    held = sys.modules.get(module)
    for part in qualname.split("."):
        held = getattr(held, part, None)
    return f"{module}:{qualname}" if held is fn else None


class Entry:
    """One search's place in the cache: load() its result when present, save() it after the walk."""

    def __init__(self, path: Path, digest: str) -> None:
        self.path, self.digest = path, digest

    def load(self) -> Any:
        import pickle

        from gpuprov.planning.space import SearchResult

        try:
            found = pickle.loads(self.path.read_bytes())  # noqa: S301 - this user's own private folder
        except Exception:  # noqa: BLE001 - absent, truncated or written by other code: walk again
            return None
        if isinstance(found, tuple) and len(found) == 2 and found[0] == self.digest \
                and isinstance(found[1], SearchResult):
            return found[1]
        return None

    def save(self, result: Any) -> None:
        import pickle

        from gpuprov.usercache import write_atomic

        try:
            data = pickle.dumps((self.digest, result), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - a value pickle cannot write: nothing kept
            return
        trim(self.path.parent, "*.pickle", KEEP)
        write_atomic(self.path, data)


def entry(spec: Any, arch: Any, estimator: Any, instances: list[Any], gpus: dict[str, Any], exhaustive: bool,
          only_nodes: int | None) -> Entry | None:
    """The cache entry of one search, or None where the memo is off, unusable, or the inputs are not all data
    a hash can cover (an estimator not named in gpuprov, a spec that is not a pydantic model)."""
    if not ENABLED or os.environ.get("GPUPROV_NO_CACHE", "") not in ("", "0"):
        return None
    name = _named(estimator)
    if name is None or not hasattr(spec, "model_dump_json"):
        return None
    import hashlib
    import pickle

    try:
        key = pickle.dumps((type(spec).__module__, type(spec).__qualname__, spec.model_dump_json(),
                            sorted(spec.model_fields_set), arch, instances, sorted(gpus.items()), name, exhaustive,
                            only_nodes), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - an input pickle cannot write: no memo for it
        return None
    from gpuprov.usercache import cache_dir

    folder = cache_dir("search")
    if folder is None:
        return None
    digest = hashlib.sha256(code_tag() + key).hexdigest()
    return Entry(folder / f"{digest[:40]}.pickle", digest)
