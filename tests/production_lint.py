"""One `ansible-lint --profile production` run for the whole suite, shared by the tests that lint.

It lints, together: the repo's roles (ansible/roles/, every file), the glue a bundle renders for a
sample plan of each target (site.yml, health.yml, group_vars, the on-prem inventory) and the glue
of each committed example, generated now (real catalog values: OCI's 16 HCAs, long sources).
A bundle's roles/ is a byte copy of ansible/roles/ (test_ansible_render: copied verbatim), so the
glue is written beside one roles/ folder, the repo's own: linting a copy per bundle would lint the
same roles five more times (ansible-lint's syntax check and rules then dominate the suite's lint time).

`production_lint()` runs it once per session; each test asserts on the files it owns: that they
were examined (a lint that skipped them would pass) and that no rule fired on them.
"""

from __future__ import annotations

import atexit
import functools
import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ansible_helpers import ANSIBLE_LINT, REPO, ansible_env, write_files

ROLES = REPO / "ansible" / "roles"
TARGETS = ("aws", "gcp", "azure", "oci", "onprem")


@dataclass(frozen=True)
class LintRun:
    returncode: int
    output: str  # ansible-lint's log and summary
    examined: frozenset[Path]  # every file ansible-lint examined, resolved
    issues: tuple[dict, ...]  # its findings (codeclimate JSON), each with location.path resolved
    glue: tuple[Path, ...]  # the rendered glue files it was given

    def issues_under(self, folder: Path) -> list[dict]:
        folder = folder.resolve()
        return [i for i in self.issues if folder in Path(i["location"]["path"]).parents]

    def issues_in(self, paths: list[Path]) -> list[dict]:
        wanted = {p.resolve() for p in paths}
        return [i for i in self.issues if Path(i["location"]["path"]) in wanted]


def role_files(folder: Path) -> list[Path]:
    """The files of a role folder ansible-lint must examine: its YAML (tasks, handlers, defaults, meta)."""
    return sorted(p for p in folder.rglob("*.yml") if p.is_file())


def _glue(root: Path) -> list[str]:
    from gpuprov.render.ansible import render_ansible
    from plan_fixtures import sample_plan

    targets = []
    for name in TARGETS:
        files = {rel: text for rel, text in render_ansible(sample_plan(name)).items() if not rel.startswith("roles/")}
        write_files(root / name, files)
        targets += [f"{name}/site.yml", f"{name}/health.yml", f"{name}/group_vars/all.yml"]
        if name == "onprem":
            targets.append(f"{name}/inventory.yml")
    sys.path.insert(0, str(REPO / "scripts"))
    import regen_examples

    for example in regen_examples.example_dirs():
        files = regen_examples.example_files(example)
        for rel in ("ansible/group_vars/all.yml", "ansible/inventory.yml"):
            if rel in files:
                write_files(root / "examples" / example.name, {rel[len("ansible/"):]: files[rel]})
                targets.append(f"examples/{example.name}/{rel[len('ansible/'):]}")
    return targets


@functools.lru_cache(maxsize=1)
def production_lint() -> LintRun:
    root = Path(tempfile.mkdtemp(prefix="gpuprov-lint-"))  # outside pytest's shared, pruned base
    atexit.register(shutil.rmtree, root, True)
    (root / "roles").symlink_to(ROLES)  # the playbooks' roles resolve to the repo's own
    glue = _glue(root)
    env = dict(ansible_env(root / ".scratch"), ANSIBLE_ROLES_PATH=str(root / "roles"))
    proc = subprocess.run([str(ANSIBLE_LINT), "-vv", "--profile", "production", "--offline", "--nocolor",
                           "--format", "codeclimate", "roles/", *glue], cwd=root, capture_output=True, text=True,
                          timeout=1200, env=env)
    examined = frozenset((root / p).resolve() for p in re.findall(r"Examining (\S+) of type", proc.stderr))
    issues = tuple(json.loads(proc.stdout or "[]"))
    for issue in issues:
        issue["location"]["path"] = str((root / issue["location"]["path"]).resolve())
    return LintRun(proc.returncode, proc.stdout + proc.stderr, examined, issues,
                   tuple((root / g).resolve() for g in glue))
