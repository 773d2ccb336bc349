"""The one way gpuprov reads a file from a bundle or an input, and writes one beside its target.

Reading: regular files only. The file is opened with O_NONBLOCK (a FIFO cannot hang the open) and,
inside a bundle, O_NOFOLLOW (a symlink planted at a bundle path is refused, not followed); fstat
then refuses anything that is not a regular file (FIFO, device, directory, socket), and the read is
capped. Every refusal is one GpuprovError line (exit 2).

Writing: a temporary file from mkstemp (O_CREAT|O_EXCL, a random name, mode 0600) in the target's
own directory, then renamed over the target. A symlink planted at any fixed name is never
followed, and the target is never half-written.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Iterable

from gpuprov.errors import GpuprovError

MAX_INPUT_BYTES = 1 << 20  # a spec or hosts file is a few KiB
MAX_BUNDLE_BYTES = 16 << 20  # the largest generated file (plan.json, a role file) is well under 1 MiB
BUNDLE_FOLDERS = ("terraform", "ansible", "launch")
# what gpuprov itself reads or writes in a bundle beside the generated files (up's state, the values
# terraform applies, the inventory up writes): regular files or absent
USER_READ = (".gpuprov-up.json", "terraform/terraform.tfvars", "ansible/inventory.yml")
_KIND = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
         stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory", stat.S_IFLNK: "a symbolic link"}


def kind_of(mode: int) -> str:
    return _KIND.get(stat.S_IFMT(mode), "not a regular file")


def read_bytes(path: str | Path, *, limit: int = MAX_BUNDLE_BYTES, follow: bool = False,
               what: str = "file") -> bytes:
    """The bytes of a regular file of at most `limit` bytes, or one GpuprovError line.

    follow=False (bundle files) refuses a symlink at the last component; follow=True (a spec, a
    hosts file, a Hugging Face cache, whose snapshots are symlinks) follows it, then checks what
    it points at."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise GpuprovError(f"{path}: no such file") from None
    except OSError as exc:
        if exc.errno == 40 and not follow:  # ELOOP: O_NOFOLLOW met a symlink
            raise GpuprovError(f"{path}: is a symbolic link; gpuprov reads only regular files here") from None
        raise GpuprovError(f"{path}: cannot read: {exc.strerror or type(exc).__name__}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise GpuprovError(f"{path}: is {kind_of(info.st_mode)}, expected a regular file")
        if info.st_size > limit:
            raise GpuprovError(f"{path}: larger than {_size(limit)}; not a {what}")
        chunks, total = [], 0
        while True:  # a file that grows while read is still capped
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise GpuprovError(f"{path}: larger than {_size(limit)}; not a {what}")
        return b"".join(chunks)
    except OSError as exc:
        raise GpuprovError(f"{path}: cannot read: {exc.strerror or type(exc).__name__}") from None
    finally:
        os.close(fd)


def read_text(path: str | Path, *, limit: int = MAX_BUNDLE_BYTES, follow: bool = False,
              what: str = "file") -> str:
    """read_bytes decoded as UTF-8 text without NUL bytes, or one GpuprovError line."""
    data = read_bytes(path, limit=limit, follow=follow, what=what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise GpuprovError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    if "\0" in text:
        raise GpuprovError(f"{path}: binary data (a NUL byte), expected text")
    return text


def _size(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit > 1 << 20 else f"{limit >> 10} KiB"


def exists_regular(path: str | Path) -> bool:
    """A regular file (not followed through a symlink) is at `path`."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def write_atomic(path: str | Path, text: str, *, mode: int | None = 0o644) -> None:
    """Write `text` to a fresh mkstemp file beside `path`, then rename it over `path`.

    mode None keeps the mode of the file being replaced (0644 when there is none). OSError
    propagates; the temporary file never outlives a failure."""
    path = Path(path)
    if mode is None:
        try:
            mode = stat.S_IMODE(os.lstat(path).st_mode) if exists_regular(path) else 0o644
        except OSError:
            mode = 0o644
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name[:64]}.", suffix=".gpuprov-tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(text.encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def check_bundle_tree(root: str | Path, expected: Iterable[str] = (), *,
                      skip: tuple[str, ...] = ("terraform/.terraform",)) -> None:
    """Refuse a bundle whose terraform/, ansible/ or launch/ folder is a symlink, or that holds a
    symlink, FIFO, device or socket there, or anything but a regular file at a path in `expected`
    (the lock's files, its state file): the tools `up` and `validate` run would follow or hang on
    them, and `up` writes into ansible/. One GpuprovError line naming the first one."""
    root = Path(root)
    for rel in sorted({*expected, *USER_READ}):
        try:
            info = os.lstat(root / rel)
        except OSError:
            continue  # missing: the command says so where it needs the file
        if not stat.S_ISREG(info.st_mode):
            raise GpuprovError(f"{root}: {rel} is {kind_of(info.st_mode)}, expected a regular file "
                               "(remove it, or regenerate the bundle)")
    for folder in BUNDLE_FOLDERS:
        top = root / folder
        try:
            info = os.lstat(top)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise GpuprovError(f"{top}: cannot read: {exc.strerror}") from None
        if stat.S_ISLNK(info.st_mode):
            raise GpuprovError(f"{top}: is a symbolic link; a bundle's {folder}/ must be a real folder inside it")
        if not stat.S_ISDIR(info.st_mode):
            raise GpuprovError(f"{top}: is {kind_of(info.st_mode)}, expected a folder")
        for current, dirs, names in os.walk(top):
            rel = Path(current).relative_to(root).as_posix()
            dirs[:] = sorted(d for d in dirs if f"{rel}/{d}" not in skip and not _refuse(root, current, d))
            for name in sorted(names):
                _refuse(root, current, name)


def refuse_special(root: str | Path, generated: Iterable[str]) -> None:
    """For `check`, which reports a symlink or a missing file as drift: refuse only what would hang
    or mislead a read, a FIFO, device or socket at a generated path, and anything but a regular file
    at the paths gpuprov itself reads or writes (USER_READ)."""
    root = Path(root)
    for rel in sorted({*generated, *USER_READ}):
        try:
            mode = os.lstat(root / rel).st_mode
        except OSError:
            continue
        strict = rel in USER_READ
        if not stat.S_ISREG(mode) and (strict or not (stat.S_ISLNK(mode) or stat.S_ISDIR(mode))):
            raise GpuprovError(f"{root}: {rel} is {kind_of(mode)}, expected a regular file "
                               "(remove it, or regenerate the bundle)")


def _refuse(root: Path, folder: str, name: str) -> bool:
    """Raise for an entry that is neither a plain folder nor a regular file (False otherwise)."""
    full = os.path.join(folder, name)
    try:
        info = os.lstat(full)
    except OSError as exc:
        raise GpuprovError(f"{full}: cannot read: {exc.strerror}") from None
    if stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode):
        return False
    rel = Path(full).relative_to(root).as_posix()
    raise GpuprovError(f"{root}: {rel} is {kind_of(info.st_mode)}; a bundle holds only regular files "
                       "(remove it, or regenerate the bundle)")
