"""Helpers for the injection tests: run the CLI in-process, and reduce a rendered bundle to what
Terraform, YAML and bash make of it (resources and variables, key trees, commands run), so a run
with a hostile value can be compared with a benign one."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
from pathlib import Path

import yaml

from gpuprov.bundle import render_files

PWNED = "gpuprov-pwned"  # the file a successful shell injection would create


def cli(*argv: str, cwd: Path | None = None) -> tuple[int, str, str]:
    """`gpuprov ARGV` in this process: (exit code, stdout, stderr). An uncaught exception propagates."""
    from gpuprov.cli import main

    out, err = io.StringIO(), io.StringIO()
    previous = Path.cwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(argv))
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    finally:
        os.chdir(previous)
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(code: int, err: str) -> str:
    assert code == 2, (code, err)
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("Usage: ", "Try '"))]
    assert len(lines) == 1, err
    return lines[0]


def write_files(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        if rel.endswith((".sh", ".sbatch")):
            target.chmod(0o755)
    return root


def bundle_to(root: Path, plan) -> Path:
    return write_files(root, render_files(plan))


# ---- Terraform -----------------------------------------------------------------------------------

def terraform_shape(terraform_dir: Path) -> dict[str, list[str]]:
    """Blocks Terraform's loader sees: resources, data sources, variables, outputs, locals; and the
    names terraform.tfvars.example would set (loaded as the body of a locals block)."""
    from terraform_support import load_module

    probe = terraform_dir.parent / f"{terraform_dir.name}.probe"
    probe.mkdir(exist_ok=True)
    for path in terraform_dir.glob("*.tf"):
        (probe / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    example = terraform_dir / "terraform.tfvars.example"
    if example.is_file():
        (probe / "zz_tfvars_probe.tf").write_text("locals {\n" + example.read_text(encoding="utf-8") + "\n}\n")
    module = load_module(probe)
    return {key: sorted(module.get(key) or {}) for key in
            ("ManagedResources", "DataResources", "Variables", "Outputs", "Locals", "ModuleCalls")}


# ---- YAML ----------------------------------------------------------------------------------------

def key_tree(node: object) -> object:
    """The structure of a YAML document: mappings as {key: subtree}, sequences as [subtrees]."""
    if isinstance(node, dict):
        return {str(k): key_tree(v) for k, v in node.items()}
    if isinstance(node, list):
        return [key_tree(v) for v in node]
    return type(node).__name__ if not isinstance(node, str) else "str"


def yaml_files(root: Path) -> dict[str, object]:
    """Every rendered .yml/.yaml file of a bundle (roles are copied as they are), loaded by PyYAML
    (YAML 1.1, what Ansible reads)."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.suffix in (".yml", ".yaml") and path.is_file() and "roles" not in rel.parts:
            found[rel.as_posix()] = yaml.load(path.read_text(encoding="utf-8"), Loader=AnsibleSafeLoader)
    return found


class AnsibleSafeLoader(yaml.SafeLoader):
    """PyYAML's safe loader plus Ansible's `!unsafe` tag (a string Ansible never templates)."""


AnsibleSafeLoader.add_constructor("!unsafe", lambda loader, node: loader.construct_scalar(node))


# ---- shell ---------------------------------------------------------------------------------------

def scripts(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix in (".sh", ".sbatch") and p.is_file())


def bash_n(script: Path) -> str:
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    return proc.stderr if proc.returncode else ""


def run_launch(root: Path, **extra_env: str) -> list[str]:
    """Run launch/env.sh and train.sh with a launcher that only prints its arguments: (argv lines).

    A value that escaped its quotes would run as a command; tests check for the PWNED file."""
    launch = root / "launch"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(root), "TORCHRUN": "printf %s\\n",
           "GPUPROV_INVENTORY": str(root / "no-inventory"), "GPUPROV_NODE_RANK": "0", **extra_env}
    proc = subprocess.run(["bash", str(launch / "train.sh")], cwd=root, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()
