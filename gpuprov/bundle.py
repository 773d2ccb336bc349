"""The bundle: every renderer's files plus plan.json and gpuprov.lock, written atomically or as a tar.

Layout (TEAM.md): README.md, topology.svg, memory.svg, cost.svg, plan.json, gpuprov.lock, terraform/, ansible/, launch/.
Deterministic bytes: sorted keys, no timestamps, fixed modes (0644, 0755 for *.sh/*.sbatch), and a
tar stream with sorted entries, mtime 0 and root ownership, so GitOps diffs show only real changes.

Writing a directory never leaves half a bundle: files are built in a temporary directory beside the
target, then swapped in with renames. Files the user added (terraform state, .terraform/, the
inventory `gpuprov up` writes, its state file) are carried into the new bundle by hard links; files
gpuprov wrote and the user edited since (hash differs from the lock) stop the write unless `force`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import importlib
import json
import os
import re
import shlex
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterable

from gpuprov.errors import GpuprovError
from gpuprov.render import EXECUTABLE_SUFFIXES

LOCK_NAME = "gpuprov.lock"
PLAN_NAME = "plan.json"
UP_STATE_NAME = ".gpuprov-up.json"  # written by `gpuprov up`; not generated, never drift
LOCK_FORMAT = 1
TAR_PREFIX = "infra"
STAGING_MARK = "gpuprov-new-"  # .NAME.gpuprov-new-XXXX: a bundle being written beside NAME

# Files the user (or `gpuprov up`, or Terraform) keeps inside the generated folders: not drift.
# The lock lists them under "keep"; add patterns there for files of your own. A pattern matches
# path segments: `*` and `?` stay inside one segment (never cross `/`), `**` spans any number of
# segments. No pattern ever keeps a file Terraform, Ansible or the trainer loads (is_loadable).
USER_FILES: tuple[str, ...] = (
    "terraform/.terraform/**", "terraform/.terraform.lock.hcl", "terraform/terraform.tfstate",
    "terraform/terraform.tfstate.backup", "terraform/terraform.tfstate.*.backup",
    "terraform/.terraform.tfstate.lock.info", "terraform/terraform.tfvars", "terraform/tfplan",
    "ansible/inventory.yml", "ansible/*.retry",
)
# the defaults of locks written before segment matching, read as today's
_LEGACY_DEFAULTS = ("terraform/.terraform/*", "terraform/.terraform.lock.hcl", "terraform/terraform.tfstate",
                    "terraform/terraform.tfstate.*", "terraform/.terraform.tfstate.lock.info",
                    "terraform/terraform.tfvars", "ansible/inventory.yml", "ansible/*.retry")
_LEGACY_KEEP = {"terraform/.terraform/*": ("terraform/.terraform/**",),
                "terraform/terraform.tfstate.*": ("terraform/terraform.tfstate.backup",
                                                  "terraform/terraform.tfstate.*.backup")}
CHECKED_FOLDERS = ("terraform", "ansible", "launch")  # where an added file changes what runs

# (bundle folder, module, function): each renderer returns paths relative to its folder
RENDERERS: tuple[tuple[str, str, str], ...] = (
    ("terraform", "gpuprov.render.terraform", "render_terraform"),
    ("ansible", "gpuprov.render.ansible", "render_ansible"),
    ("launch", "gpuprov.render.launch", "render_launch"),
    ("", "gpuprov.render.report", "render_report"),
)

Renderer = Callable[[Any], dict]


def default_renderers() -> list[tuple[str, Renderer]]:
    return [(folder, getattr(importlib.import_module(module), attr)) for folder, module, attr in RENDERERS]


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sha256_file(path: Path) -> str:
    from gpuprov.safefile import read_bytes

    return hashlib.sha256(read_bytes(path)).hexdigest()


def is_executable(path: str) -> bool:
    return path.endswith(EXECUTABLE_SUFFIXES)


def file_mode(path: str) -> int:
    return 0o755 if is_executable(path) else 0o644


def _check_relative(folder: str, path: Any, renderer: str) -> str:
    if not isinstance(path, str) or not path:
        raise GpuprovError(f"renderer {renderer} returned a bad path {path!r}")
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts or path != pure.as_posix() or "\\" in path:
        raise GpuprovError(f"renderer {renderer} returned a path outside its folder: {path!r}")
    return f"{folder}/{path}" if folder else path


def plan_json(plan: Any) -> str:
    """plan.json: the Plan with sorted keys and two-space indent (Plan.model_validate_json reads it)."""
    return json.dumps(json.loads(plan.model_dump_json()), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def parse_plan(text: str) -> Any:
    """The Plan of a plan.json text: json.loads, then validation of that data. pydantic's JSON mode
    validates every item of an over-long list before refusing it (seconds for a 1 MiB file);
    from Python data it stops at the limit. ValueError (one line first) when it does not load."""
    from gpuprov.plan import Plan

    try:
        data = json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    return Plan.model_validate(data)


def render_files(plan: Any, renderers: Iterable[tuple[str, Renderer]] | None = None) -> dict[str, str]:
    """Every generated file except the lock, keyed by bundle path, sorted (the default renderers' files from the
    user's cache where this plan was rendered before by the same code and templates: render/memo.py)."""
    text = plan_json(plan)
    if renderers is not None:
        return _render(plan, text, renderers)
    from gpuprov.render.memo import rendered

    return rendered(text, lambda: _render(plan, text, default_renderers()))


def _render(plan: Any, text: str, renderers: Iterable[tuple[str, Renderer]]) -> dict[str, str]:
    files: dict[str, str] = {PLAN_NAME: text}
    for folder, function in renderers:
        name = getattr(function, "__qualname__", repr(function))
        rendered = function(plan)
        if not isinstance(rendered, dict):
            raise GpuprovError(f"renderer {name} returned {type(rendered).__name__}, expected a dict")
        for path, text in rendered.items():
            full = _check_relative(folder, path, name)
            if not isinstance(text, str):
                raise GpuprovError(f"renderer {name} returned non-text content for {full}")
            if full in files or full in (LOCK_NAME, UP_STATE_NAME):
                raise GpuprovError(f"renderer {name} wrote {full}, which another part of the bundle owns")
            files[full] = text
    return dict(sorted(files.items()))


def lock_text(spec: Any, files: dict[str, str], keep: Iterable[str] | None = None) -> str:
    """gpuprov.lock: the full input spec, versions, a hash of every generated file and the patterns
    of user files kept in the generated folders (JSON, sorted)."""
    from gpuprov import __version__
    from gpuprov.catalog import catalog_version

    lock = {
        "lock_format": LOCK_FORMAT,
        "gpuprov_version": __version__,
        "catalog_version": catalog_version(),
        "spec": spec.model_dump(mode="json"),
        "files": {path: sha256_text(text) for path, text in sorted(files.items())},
        "keep": list(USER_FILES if keep is None else keep),
    }
    return json.dumps(lock, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def build_bundle(plan: Any, renderers: Iterable[tuple[str, Renderer]] | None = None,
                 keep: Iterable[str] | None = None) -> dict[str, str]:
    """All files of the bundle, lock included, in memory (nothing touches the disk)."""
    files = render_files(plan, renderers)
    files[LOCK_NAME] = lock_text(plan.spec, files, keep)
    return dict(sorted(files.items()))


def lock_keep(lock: dict | None) -> list[str]:
    """The lock's user-file patterns (older locks have none: the defaults)."""
    keep = (lock or {}).get("keep")
    if keep is None:
        return list(USER_FILES)
    if not isinstance(keep, list) or not all(isinstance(k, str) for k in keep) or len(keep) > 1000:
        raise GpuprovError(f"{LOCK_NAME}: keep must be a list of file patterns")
    if tuple(keep) == _LEGACY_DEFAULTS:
        keep = list(USER_FILES)
    keep = [new for k in keep for new in _LEGACY_KEEP.get(k, (k,))]
    bad = next((k for k in keep if not k or "\0" in k or len(k) > 4096 or k.startswith("/")
                or ".." in k.split("/")), None)
    if bad is not None:
        raise GpuprovError(f"{LOCK_NAME}: keep pattern {bad[:80]!r} is not a relative file pattern")
    hiding = next((k for k in keep if could_hide_code(k)), None)
    if hiding is not None:
        raise GpuprovError(f"{LOCK_NAME}: keep pattern {hiding[:80]!r} could hide an added "
                           f"{'/'.join(CHECKED_FOLDERS)} file that runs (Terraform, Ansible or launch files); keep "
                           "only data files, e.g. \"terraform/*.tfplan\" or \"launch/*.log\"")
    return keep


# What Terraform, Ansible and the launch scripts read or run is kept nowhere, whatever the lock
# says. Terraform loads every *.tf/*.tf.json of its folder, auto-loads *.auto.tfvars(.json) and
# terraform.tfvars(.json), and installs plugins from terraform.d/; Ansible reads every playbook,
# role file, template, inventory, ansible.cfg and plugin folder; the launch scripts source and
# run what sits beside them.
TERRAFORM_SUFFIXES = (".tf", ".tf.json", ".tfvars", ".tfvars.json", ".hcl")
# what ansible/ and launch/ may keep: logs, retry lists and tables no tool there reads on its own
DATA_SUFFIXES = (".retry", ".log", ".out", ".err", ".csv", ".tsv", ".jsonl")
# the only loadable files a user keeps: the values `up` reads, the provider hashes `init` writes
# and the inventory `up` writes (each read and checked by gpuprov itself)
_KEPT_LOADABLE = frozenset({"terraform/terraform.tfvars", "terraform/.terraform.lock.hcl", "ansible/inventory.yml"})
_WILD = re.compile(r"[*?[]")


def is_loadable(path: str) -> bool:
    """Whether a tool of the bundle loads `path` (bundle-relative): an added one is always drift.

    In ansible/ and launch/ every file but logs, .retry files and tables; in terraform/ configuration,
    variable and .hcl files and terraform.d/ (state, backups, the saved plan are data; Terraform's
    own .terraform/ folder is filled by `init` and checked against the lock file's hashes)."""
    if path in _KEPT_LOADABLE:
        return False
    folder, _, rest = path.partition("/")
    if folder not in CHECKED_FOLDERS or not rest:
        return False
    parts = rest.split("/")
    if folder == "terraform":
        return parts[0] != ".terraform" and (parts[-1].endswith(TERRAFORM_SUFFIXES) or "terraform.d" in parts)
    return not parts[-1].endswith(DATA_SUFFIXES)


def could_hide_code(pattern: str) -> bool:
    """Whether `pattern` can match a loadable file (is_loadable): decided on the last segment's
    literal tail after its last wildcard, which every match ends with."""
    segments = pattern.split("/")
    first = segments[0]
    folders = [first] if first in CHECKED_FOLDERS else list(CHECKED_FOLDERS) if _WILD.search(first) else []
    if not folders or pattern in _KEPT_LOADABLE:
        return False
    if folders == ["terraform"] and len(segments) > 2 and segments[1] == ".terraform":
        return False  # Terraform's own cache
    if len(segments) == 1 or "**" in segments[-1]:
        return True
    last, dirs = segments[-1], segments[1:-1]
    tail = re.split(r"[*?\]]", last)[-1]
    for folder in folders:
        if folder != "terraform":
            if not (tail if tail != last else last).endswith(DATA_SUFFIXES):
                return True
        elif "terraform.d" in dirs or any(_WILD.search(d) for d in dirs):
            return True
        elif tail == last:
            if is_loadable(f"terraform/{last}"):
                return True
        elif any(s.endswith(tail) or tail.endswith(s) for s in TERRAFORM_SUFFIXES):
            return True
    return False


def _match_segments(parts: list[str], pattern: list[str]) -> bool:
    """Glob on path segments: fnmatch per segment (`*` inside one), `**` for any number of them.
    The set of pattern positions reached so far, one path segment at a time: linear in both."""
    def closed(states: set[int]) -> set[int]:
        out = set(states)
        for j in sorted(states):
            while j < len(pattern) and pattern[j] == "**":
                j += 1
                out.add(j)
        return out

    states = closed({0})
    for part in parts:
        states = closed({j if pattern[j] == "**" else j + 1 for j in states
                         if j < len(pattern) and (pattern[j] == "**" or fnmatch.fnmatchcase(part, pattern[j]))})
        if not states:
            return False
    return len(pattern) in states


def keep_matches(path: str, pattern: str) -> bool:
    return _match_segments(path.split("/"), pattern.split("/"))


def extra_keep(keep: Iterable[str]) -> list[str]:
    """The lock's keep patterns beyond the defaults (check lists them)."""
    return [k for k in keep if k not in USER_FILES]


def is_kept(path: str, keep: Iterable[str]) -> bool:
    if path == UP_STATE_NAME:
        return True
    return not is_loadable(path) and any(keep_matches(path, pattern) for pattern in keep)


# ---------------------------------------------------------------- reading an existing bundle


def read_lock(directory: Path) -> dict:
    from gpuprov.safefile import read_text

    path = Path(directory) / LOCK_NAME
    if not os.path.lexists(path):
        raise GpuprovError(f"{directory}: not a gpuprov bundle (no {LOCK_NAME})")
    try:
        lock = json.loads(read_text(path, what="lock"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise GpuprovError(f"{path}: unreadable lock ({type(exc).__name__}); regenerate with --force") from None
    if (not isinstance(lock, dict) or not isinstance(lock.get("files"), dict)
            or not isinstance(lock.get("spec"), dict) or lock.get("lock_format") != LOCK_FORMAT):
        raise GpuprovError(f"{path}: not a gpuprov lock of format {LOCK_FORMAT}; regenerate with --force")
    bad = next((p for p, digest in lock["files"].items() if _bad_lock_path(p) or not _is_digest(digest)), None)
    if bad is not None or len(lock["files"]) > MAX_LOCK_FILES:
        shown = repr(bad[:80]) if isinstance(bad, str) else f"{len(lock['files']):,} files"
        raise GpuprovError(f"{path}: files lists {shown}, not a bundle path with its sha256; regenerate with --force")
    lock_keep(lock)  # a bad keep pattern is refused here, before any command walks the bundle
    return lock


MAX_LOCK_FILES = 10_000  # a bundle has a few hundred files


def _bad_lock_path(path: Any) -> bool:
    """Not a plain relative POSIX path inside the bundle (NUL or control bytes, .., absolute, too long)."""
    if not isinstance(path, str) or not path or len(path) > 1024 or any(ord(ch) < 32 for ch in path):
        return True
    pure = PurePosixPath(path)
    return pure.is_absolute() or ".." in pure.parts or "\\" in path or pure.as_posix() != path


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


def spec_from_lock(lock: dict, where: str = LOCK_NAME, resolve: bool = True):
    """The lock's spec; a relative model path is relative to the lock's folder (resolve=False: kept
    as written, for `check` with the model's config pinned from plan.json)."""
    from pydantic import ValidationError

    from gpuprov.spec import TrainingSpec
    from gpuprov.specfile import _resolve_model, format_validation_error

    data = dict(lock["spec"])
    if resolve and isinstance(data.get("model"), str) and data["model"].strip():
        data["model"] = _resolve_model(data["model"], Path(where).absolute().parent)
    try:
        return TrainingSpec.model_validate(data)
    except ValidationError as exc:
        raise GpuprovError(f"{where}: spec no longer valid: {format_validation_error(exc)}") from None


def edited_files(directory: Path, lock: dict) -> list[str]:
    """Generated files whose bytes no longer match the lock (someone edited them)."""
    edited = []
    for path, digest in sorted(lock["files"].items()):
        on_disk = directory / path
        if on_disk.is_file() and not on_disk.is_symlink() and sha256_file(on_disk) != digest:
            edited.append(path)
        elif on_disk.exists() and (on_disk.is_symlink() or not on_disk.is_file()):
            edited.append(path)
    return edited


def _walk_files(directory: Path) -> list[str]:
    """Every file and symlink under directory, relative POSIX paths, sorted."""
    found = []
    for root, dirs, names in os.walk(directory):
        rel_root = Path(root).relative_to(directory)
        for name in list(dirs):
            if os.path.islink(os.path.join(root, name)):
                dirs.remove(name)
                names.append(name)
        for name in names:
            found.append((rel_root / name).as_posix())
    return sorted(found)


# ---------------------------------------------------------------- writing


@dataclass
class WriteResult:
    path: Path
    files: int
    carried: list[str]
    replaced: bool
    cleaned: list[str] = field(default_factory=list)  # stale staging folders removed
    leftover: str | None = None  # why the previous bundle could not be removed


def _write_tree(root: Path, files: dict[str, str]) -> None:
    """Every file into the fresh folder `root`, each folder made once (parents first); modes set explicitly."""
    base = str(root)
    for folder in sorted({path[:i] for path in files for i, ch in enumerate(path) if ch == "/"}):
        os.mkdir(os.path.join(base, folder))
        os.chmod(os.path.join(base, folder), 0o755)  # the umask must not change the bundle
    for path, text in files.items():
        fd = os.open(os.path.join(base, path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "wb") as handle:
            handle.write(text.encode("utf-8"))
            os.fchmod(fd, file_mode(path))
    os.chmod(root, 0o755)


def _special(path: Path) -> bool:
    """A FIFO, device or socket (lstat: a symlink is not special)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode))


def _carry(old: Path, new: Path, paths: list[str]) -> None:
    """Hard-link the user's own files (state, caches) into the new tree; the old tree keeps them too."""
    for path in paths:
        source, target = old / path, new / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            os.symlink(os.readlink(source), target)
            continue
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    errno = ctypes.get_errno()
    if errno in (38, 22, 95):  # ENOSYS, EINVAL (filesystem cannot), EOPNOTSUPP: use two renames
        return False
    raise OSError(errno, os.strerror(errno), str(b))


def _swap_in(new: Path, target: Path) -> None:
    """Put `new` at `target`; the old target ends up at `new`'s path (removed by the caller)."""
    if not target.exists():
        os.rename(new, target)
        return
    if _exchange(new, target):
        return
    parking = Path(tempfile.mkdtemp(prefix=f".{target.name}.gpuprov-old-", dir=target.parent))
    os.rmdir(parking)
    os.rename(target, parking)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(parking, target)
        raise
    os.rename(parking, new)


def _recover_parked(target: Path) -> None:
    """A crash between the two renames of the fallback swap leaves the old bundle parked: restore it."""
    with contextlib.suppress(OSError):
        parked = sorted(target.parent.glob(f".{target.name}.gpuprov-old-*"), key=lambda p: p.stat().st_mtime)
        if parked and (parked[-1] / LOCK_NAME).is_file():
            os.rename(parked[-1], target)


def _remove_tree(path: Path) -> str | None:
    """rmtree that makes read-only folders writable first; why it failed, or None."""
    def retry(function, name, _exc):
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(name), 0o700)
            os.chmod(name, 0o700) if os.path.isdir(name) and not os.path.islink(name) else None
            function(name)

    shutil.rmtree(path, onerror=retry)
    if os.path.lexists(path):
        return f"could not remove {path}; delete it by hand"
    return None


def _hold(directory: Path) -> int:
    """An exclusive flock on a staging folder while this process writes it (a crash releases it)."""
    import fcntl

    fd = os.open(directory, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def clean_stale_staging(target: Path) -> list[str]:
    """Remove .NAME.gpuprov-new-* folders no running gpuprov holds (left by a killed write)."""
    import fcntl

    removed = []
    for stale in sorted(target.parent.glob(f".{target.name}.{STAGING_MARK}*")):
        try:
            fd = os.open(stale, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another gpuprov is writing it
            os.close(fd)
            continue
        try:
            if _remove_tree(stale) is None:
                removed.append(stale.name)
        finally:
            os.close(fd)
    return removed


def _os_error(target: Path, exc: OSError) -> GpuprovError:
    where = exc.filename or target
    return GpuprovError(f"cannot write bundle {target}: {exc.strerror or exc} ({where})")


def write_bundle(target: str | Path, files: dict[str, str], *, force: bool = False) -> WriteResult:
    """Write `files` (from build_bundle) as the directory `target`, atomically."""
    # absolute: `-o .` must stage beside the directory, not inside it
    target = Path(target).absolute()
    if target.is_symlink():
        try:
            target = target.resolve()
        except (OSError, RuntimeError):  # a symlink loop (Python 3.11 raises RuntimeError)
            raise GpuprovError(f"{target}: is a symbolic link that loops; cannot write a bundle there") from None
    if not target.exists():
        _recover_parked(target)
    if target.exists() and not target.is_dir():
        raise GpuprovError(f"{target} exists and is not a directory")
    if target.is_dir() and Path.cwd().resolve().is_relative_to(target.resolve()):
        # the swap replaces the directory: a shell inside it would be left in a deleted folder
        raise GpuprovError(f"{target} is (or contains) the current directory; run gpuprov from outside it "
                           "(the bundle directory is replaced as a whole)")
    old_lock: dict | None = None
    carried: list[str] = []
    replaced = False
    if target.is_dir():
        try:
            existing = _walk_files(target)
        except OSError as exc:
            raise _os_error(target, exc) from None
        if existing or any(target.iterdir()):
            if not (target / LOCK_NAME).exists():
                raise GpuprovError(f"{target} is not empty and is not a gpuprov bundle (no {LOCK_NAME}); "
                                   "choose an empty or new directory")
            try:
                old_lock = read_lock(target)
            except GpuprovError:
                if not force:
                    raise
            replaced = True
        tracked = set(old_lock["files"]) if old_lock else set()
        if old_lock is not None:
            problems = edited_files(target, old_lock)
        else:
            problems = []
        # the user's own file where gpuprov would now write one
        problems += [p for p in existing if p in files and p not in tracked and p != LOCK_NAME]
        if problems and not force:
            shown = ", ".join(problems[:5]) + (f" and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise GpuprovError(f"refusing to overwrite files edited by hand in {target}: {shown} "
                               f"(see `gpuprov check {shlex.quote(str(target))}`; --force overwrites them)")
        # without a readable lock (forced), nothing counts as generated: carry everything not regenerated
        carried = [p for p in existing if p not in files and p not in tracked and p != LOCK_NAME]
        special = next((p for p in carried if _special(target / p)), None)
        if special is not None:  # a FIFO or device would be linked into the new bundle, where up refuses it
            raise GpuprovError(f"{target}: {special} is not a regular file, folder or symlink; remove it first")
    if old_lock is not None and old_lock.get("keep") is not None and LOCK_NAME in files:
        files = {**files, LOCK_NAME: _with_keep(files[LOCK_NAME], lock_keep(old_lock))}  # the user's patterns stay
    parent = target.parent if str(target.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        cleaned = clean_stale_staging(target)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.{STAGING_MARK}", dir=parent))
        held = _hold(staging)
    except OSError as exc:
        raise _os_error(target, exc) from None
    try:
        _write_tree(staging, files)
        _carry(target, staging, carried)
        _swap_in(staging, target)
    except OSError as exc:
        _remove_tree(staging)
        raise _os_error(target, exc) from None
    except BaseException:
        _remove_tree(staging)
        raise
    finally:
        os.close(held)
    leftover = _remove_tree(staging)  # now the previous bundle
    return WriteResult(path=target, files=len(files), carried=carried, replaced=replaced,
                       cleaned=cleaned, leftover=leftover)


def _with_keep(lock_json: str, keep: list[str]) -> str:
    lock = json.loads(lock_json)
    lock["keep"] = keep
    return json.dumps(lock, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


# ---------------------------------------------------------------- comparing (gpuprov check)


@dataclass
class Difference:
    status: str  # modified, missing, stale, mode, added, symlink, unreadable
    path: str
    diff: str  # short unified diff ('' where it does not apply)


def _short_diff(path: str, old: str, new: str, limit: int) -> str:
    import difflib  # here: a bundle written to a folder shows no diff

    lines = list(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                      fromfile=f"a/{path} (on disk)", tofile=f"b/{path} (regenerated)", n=1))
    if len(lines) > limit:
        lines = lines[:limit] + [f"... {len(lines) - limit} more diff lines\n"]
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines)


def _linked(directory: Path, path: str) -> bool:
    """A symlink anywhere on the way from the bundle's root to `path`."""
    current = directory
    for part in PurePosixPath(path).parts:
        current = current / part
        if current.is_symlink():
            return True
    return False


def compare_bundle(directory: str | Path, files: dict[str, str], *, diff_lines: int = 30) -> list[Difference]:
    """What `generate` would change in `directory`: generated files, symlinks where they belong, and
    files added to terraform/, ansible/ or launch/ that the lock's "keep" patterns do not cover."""
    directory = Path(directory)
    old_lock = None
    with contextlib.suppress(GpuprovError):
        old_lock = read_lock(directory)
    differences = []
    for path, text in files.items():
        differences.extend(_compare_one(directory, path, text, diff_lines))
    if old_lock is not None:
        for path in sorted(set(old_lock["files"]) - set(files)):
            if os.path.lexists(directory / path):
                differences.append(Difference("stale", path, ""))
    known = set(files) | set(old_lock["files"] if old_lock else ())
    differences += [Difference("added", path, "") for path in added_files(directory, known, lock_keep(old_lock))]
    return differences


def added_files(directory: Path, known: Iterable[str], keep: Iterable[str]) -> list[str]:
    """Files in terraform/, ansible/ or launch/ that are neither generated (`known`) nor kept."""
    known, keep, added = set(known), list(keep), []
    for folder in CHECKED_FOLDERS:
        if not (directory / folder).is_dir() or (directory / folder).is_symlink():
            continue
        for rel in _walk_files(directory / folder):
            path = f"{folder}/{rel}"
            if path not in known and not is_kept(path, keep):
                added.append(path)
    return added


def _compare_one(directory: Path, path: str, text: str, diff_lines: int) -> list[Difference]:
    on_disk = directory / path
    if _linked(directory, path):
        return [Difference("symlink", path, "")]  # never followed: it could point anywhere
    if not on_disk.is_file():
        return [Difference("missing", path, "")]
    from gpuprov.safefile import read_bytes

    try:
        data = read_bytes(on_disk)
        mode = stat.S_IMODE(on_disk.stat().st_mode)
    except OSError as exc:
        return [Difference("unreadable", path, f"{exc.strerror or exc}\n")]
    except GpuprovError as exc:
        return [Difference("unreadable", path, f"{exc}\n")]
    if data != text.encode("utf-8"):
        old = data.decode("utf-8", errors="replace")
        return [Difference("modified", path, _short_diff(path, old, text, diff_lines))]
    if mode & 0o111 != file_mode(path) & 0o111:
        return [Difference("mode", path, "")]
    return []
