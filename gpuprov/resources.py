"""Locate the templates and Ansible roles shipped with gpuprov.

In a wheel they live inside the package (`gpuprov/_templates`, `gpuprov/_ansible`, see
pyproject's force-include); in a source checkout or editable install they are the top-level
`templates/` and `ansible/` folders of the repository.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def _locate(packaged: str, in_repo: str) -> Path:
    inside = _PACKAGE_DIR / packaged
    if inside.is_dir():
        return inside
    beside = _PACKAGE_DIR.parent / in_repo
    if beside.is_dir():
        return beside
    raise FileNotFoundError(f"gpuprov data folder {in_repo!r} is missing from this installation")


def templates_dir() -> Path:
    return _locate("_templates", "templates")


def ansible_dir() -> Path:
    return _locate("_ansible", "ansible")


def catalog_data_dir() -> Path:
    return _PACKAGE_DIR / "catalog" / "data"
