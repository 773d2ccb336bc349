"""The user's defaults file: `$XDG_CONFIG_HOME/gpuprov/config.yaml` (`~/.config/gpuprov/config.yaml`).

It holds the few spec keys a person sets the same way for every run (cloud, region, objective,
purchase), validated with the spec's own field types. Precedence, lowest first: the defaults file,
then a spec file (-f), then flags. A region there belongs to its cloud: when a spec or flag names
another cloud (or --hosts makes it on-prem) the file's cloud and region step aside. A file that does
not parse or validate is one line and exit 2, like a bad spec.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gpuprov.errors import GpuprovError

KEYS = ("cloud", "region", "objective", "purchase")


def config_path() -> Path:
    """Where the file is read from (it need not exist): XDG_CONFIG_HOME when set and absolute, else ~/.config."""
    base = os.environ.get("XDG_CONFIG_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".config"
    return root / "gpuprov" / "config.yaml"


def _model():
    from pydantic import ConfigDict, create_model

    from gpuprov.spec import TrainingSpec

    fields = {k: (TrainingSpec.model_fields[k].annotation, None) for k in KEYS}
    return create_model("UserDefaults", __config__=ConfigDict(extra="forbid", strict=False), **fields)


def user_defaults(path: Path | None = None) -> dict[str, Any]:
    """The validated keys the file sets ({} without a file)."""
    path = path or config_path()
    if not os.path.lexists(path):
        return {}
    from pydantic import ValidationError

    from gpuprov.specfile import _plain, format_validation_error, load_yaml

    tree = load_yaml(path)
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise GpuprovError(f"{path}: expected a mapping of defaults ({', '.join(f'{k}: ...' for k in KEYS)})")
    data = _plain(tree)
    extra = [k for k in data if k not in KEYS]
    if extra:
        from gpuprov.specfile import _line_of

        raise GpuprovError(f"{path}:{_line_of(tree, (extra[0],)) or 1}: {extra[0]}: unknown key (the defaults file "
                           f"takes {', '.join(KEYS)}; other keys belong in a spec file, -f)")
    if isinstance(data.get("purchase"), str):  # `purchase: spot` as the flag writes it
        data["purchase"] = [p.strip() for p in data["purchase"].split(",") if p.strip()]
    try:
        checked = _model().model_validate(data)
    except ValidationError as exc:
        raise GpuprovError(format_validation_error(exc, prefix=str(path), tree=tree)) from None
    return {k: v for k, v in checked.model_dump().items() if v is not None}


def apply_defaults(defaults: dict[str, Any], file_data: dict[str, Any], overrides: dict[str, Any],
                   hosts: bool) -> dict[str, Any]:
    """The spec file's values with the defaults under them (flags, in `overrides`, win later)."""
    if not defaults:
        return file_data
    cloud = overrides.get("cloud", file_data.get("cloud"))
    if hosts or (cloud is not None and cloud != defaults.get("cloud")):
        defaults = {k: v for k, v in defaults.items() if k not in ("cloud", "region")}
    return {**defaults, **file_data}
