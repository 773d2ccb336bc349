"""How validate and status run Ansible and Terraform on a bundle nobody vouches for.

Rule: nothing in the bundle configures the tools or runs. So the tools never start inside the
bundle: gpuprov copies the files a check reads (playbooks and role task files; .tf files) into a
fresh folder, with none of the folders Ansible or Terraform load plugins from (library/,
*_plugins/, collections/, group_vars/, terraform.d/, .terraform/), and runs the tool there with
a configuration gpuprov writes (ANSIBLE_CONFIG, TF_CLI_CONFIG_FILE, TF_DATA_DIR) and an
environment without inherited ANSIBLE_*/TF_* settings. Ansible runs with every lookup plugin
refused: its (sandboxed) Jinja can run a program only through a lookup (pipe), and a syntax check
templates role and import names.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path, PurePosixPath
from typing import Iterable

from gpuprov.errors import GpuprovError
from gpuprov.safefile import read_bytes

# folders Ansible loads code or variables from when they sit beside a playbook, inventory or in a role
ANSIBLE_LOADED_DIRS = frozenset({
    "library", "module_utils", "collections", "ansible_collections", "group_vars", "host_vars",
    "action_plugins", "become_plugins", "cache_plugins", "callback_plugins", "cliconf_plugins",
    "connection_plugins", "doc_fragments", "filter_plugins", "httpapi_plugins", "inventory_plugins",
    "lookup_plugins", "netconf_plugins", "shell_plugins", "strategy_plugins", "terminal_plugins",
    "test_plugins", "vars_plugins",
})
TERRAFORM_LOADED_DIRS = frozenset({".terraform", "terraform.d"})

# runs ansible's own CLI in its own Python with lookups refused; argv[0] names the CLI for its help
_WRAPPER = """\
import sys
from ansible.errors import AnsibleError
from ansible.plugins.loader import lookup_loader


def _refused(name, *args, **kwargs):
    raise AnsibleError("lookup %r refused: gpuprov runs no lookup from a bundle it checks" % (name,))


lookup_loader.get = _refused
from ansible.cli.{module} import main
sys.argv[0] = {name!r}
sys.exit(main())
"""


def clean_env(*prefixes: str, **extra: str) -> dict[str, str]:
    """This process's environment without variables starting with `prefixes`, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.update(extra)
    return env


def _python_of(tool: str) -> str | None:
    """The interpreter of a Python console script (its #! line), or None."""
    try:
        first = read_bytes(tool, limit=1 << 20, follow=True, what="script")[:512].split(b"\n", 1)[0]
    except GpuprovError:
        return None
    if not first.startswith(b"#!") or b"python" not in first:
        return None
    words = first[2:].decode("utf-8", "replace").split()
    if words and words[0].endswith("/env"):
        words = [w for w in words[1:] if not w.startswith("-")]
        return shutil.which(words[0]) if words else None
    return words[0] if words and os.path.isfile(words[0]) else None


def ansible_argv(tool: str, args: Iterable[str]) -> list[str] | None:
    """argv that runs the `ansible-playbook` or `ansible` CLI at `tool` with lookups refused
    (None when `tool` is not a Python console script gpuprov can start this way)."""
    python = _python_of(tool)
    name = Path(tool).name
    module = {"ansible-playbook": "playbook", "ansible": "adhoc"}.get(name)
    if python is None or module is None:
        return None
    return [python, "-c", _WRAPPER.format(module=module, name=name), *args]


def ansible_env(scratch: Path, cfg: Path, keep_user: bool = False) -> dict[str, str]:
    """Ansible's environment: gpuprov's cfg file, its temp in `scratch`, no inherited ANSIBLE_*
    (keep_user: the caller's own ANSIBLE_* settings stay, a key file for status say, but never
    ANSIBLE_CONFIG; relative paths in them resolve in `scratch`, never in the bundle)."""
    env = dict(os.environ) if keep_user else clean_env("ANSIBLE_", ANSIBLE_HOME=str(scratch / "home"))
    env.update(ANSIBLE_CONFIG=str(cfg), ANSIBLE_LOCAL_TEMP=str(scratch / "tmp"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_RETRY_FILES_ENABLED="0")
    return env


def terraform_env(scratch: Path) -> dict[str, str]:
    """Terraform's environment: an empty CLI config and a data folder of gpuprov's, no inherited TF_*."""
    rc = scratch / "gpuprov.tfrc"
    rc.write_text("")
    return clean_env("TF_", TF_CLI_CONFIG_FILE=str(rc), TF_DATA_DIR=str(scratch / "tfdata"),
                     TF_IN_AUTOMATION="1", CHECKPOINT_DISABLE="1")


def _skipped(rel: str, loaded_dirs: frozenset[str]) -> bool:
    return any(part in loaded_dirs for part in PurePosixPath(rel).parts[:-1])


def stage(root: Path, folder: str, paths: Iterable[str], suffixes: tuple[str, ...], target: Path) -> list[str]:
    """Copy the regular files among `paths` (bundle-relative, under `folder`) whose names end in
    `suffixes` to target/folder, leaving out any under a folder the tool loads code from. Returns
    the copied paths. Each file is read the guarded way (no symlink, bounded)."""
    loaded = TERRAFORM_LOADED_DIRS if folder == "terraform" else ANSIBLE_LOADED_DIRS
    copied = []
    for rel in sorted(set(paths)):
        inner = PurePosixPath(rel)
        if inner.parts[:1] != (folder,) or not rel.endswith(suffixes) or _skipped(rel, loaded):
            continue
        if ".." in inner.parts or inner.is_absolute():
            continue
        data = read_bytes(root / rel, what=f"{folder} file")
        out = target / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
        copied.append(rel)
    return copied


def tree_files(root: Path, folder: str) -> list[str]:
    """Regular files under root/folder (bundle-relative), not descending into symlinks or the
    folders its tool loads code from."""
    loaded = TERRAFORM_LOADED_DIRS if folder == "terraform" else ANSIBLE_LOADED_DIRS
    found: list[str] = []
    top = root / folder
    if top.is_symlink() or not top.is_dir():
        return found
    for current, dirs, names in os.walk(top):
        dirs[:] = sorted(d for d in dirs if d not in loaded and not os.path.islink(os.path.join(current, d)))
        rel = Path(current).relative_to(root).as_posix()
        found += [f"{rel}/{n}" for n in sorted(names) if not os.path.islink(os.path.join(current, n))]
    return found
