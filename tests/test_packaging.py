"""The wheel must carry the templates and roles: a non-editable install run elsewhere works."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
                   check=True)
    (built,) = out.glob("gpuprov-*.whl")
    return built


def _source_files(root: Path) -> list[Path]:
    """The files under `root` the checkout holds: bytecode a test run left (.gitignore's __pycache__) is not one."""
    return [p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]


def test_wheel_ships_templates_roles_and_catalogs(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    repo_templates, repo_roles = _source_files(REPO / "templates"), _source_files(REPO / "ansible")
    repo_catalogs = list((REPO / "gpuprov" / "catalog" / "data").glob("*.yaml"))
    for path in repo_templates:
        assert f"gpuprov/_templates/{path.relative_to(REPO / 'templates').as_posix()}" in names
    for path in repo_roles:
        assert f"gpuprov/_ansible/{path.relative_to(REPO / 'ansible').as_posix()}" in names
    for path in repo_catalogs:
        assert f"gpuprov/catalog/data/{path.name}" in names
    assert not any(name.startswith(("tests/", "templates/", "ansible/")) for name in names)


def test_installed_wheel_finds_its_data_from_another_directory(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True)
    probe = (
        "import gpuprov.resources as r, gpuprov;"
        "print(gpuprov.__file__); print(r.templates_dir()); print(r.ansible_dir()); print(r.catalog_data_dir())"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env={"PYTHONPATH": str(target)},
                            capture_output=True, text=True, check=True)
    lines = result.stdout.splitlines()
    assert all(line.startswith(str(target)) for line in lines), lines
    assert all(Path(line).exists() for line in lines[1:]), lines


def test_readme_installs_from_the_repository_not_from_an_index_where_it_is_absent() -> None:
    """Every install line in README.md's shell blocks installs this checkout (or a git URL), never the
    unpublished `gpuprov` name from an index; and the wheel's metadata names what an index would show."""
    import re

    text = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, flags=re.S)
    installs = [ln for b in blocks for ln in b.splitlines() if re.search(r"\bpip install\b", ln)]
    assert installs
    for line in installs:
        args = line.split("pip install", 1)[1].split("#")[0].split("&&")[0].split()
        assert not any(re.fullmatch(r"['\"]?gpuprov(\[[^\]]*\])?['\"]?", a) for a in args), line


def test_wheel_metadata_is_complete(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    for field in ("Name: gpuprov", "Version: ", "Requires-Python: ", "Summary: "):
        assert field in text, field
