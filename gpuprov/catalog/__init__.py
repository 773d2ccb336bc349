"""Catalogs: YAML data files under `data/`, every figure with a `source:`.

Loaders per catalog live beside this file (`models.py`, `gpus.py`, `instances.py`,
`fabrics.py`); this module holds what they share.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Any

from gpuprov.resources import catalog_data_dir


@lru_cache(maxsize=None)
def load_data(filename: str) -> Any:
    """Parse one catalog file (safe loader; cached: catalogs are read-only at run time)."""
    from ruamel.yaml import YAML

    path = catalog_data_dir() / filename
    with path.open(encoding="utf-8") as stream:
        return YAML(typ="safe", pure=True).load(stream)


@lru_cache(maxsize=None)
def catalog_version() -> str:
    """Content hash of every catalog file, recorded in plans and locks (drift in data shows)."""
    digest = hashlib.sha256()
    for path in sorted(catalog_data_dir().glob("*.yaml")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
