"""Model presets (data/models.yaml) and local config.json files, as ModelArch."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from gpuprov.catalog import load_data
from gpuprov.errors import GpuprovError
from gpuprov.sizing.arch import ModelArch, arch_from_hf_config


def _catalog() -> dict:
    return load_data("models.yaml")


def _aliases() -> dict[str, str]:
    return {str(k): v["model"] for k, v in (_catalog().get("aliases") or {}).items()}


def _preset(slug: str) -> ModelArch:
    # Built fresh on every call (cheap): callers hand hf_config to transformers, which rewrites
    # nested dicts such as rope_scaling in place; a cached ModelArch would carry that into plans.
    entry = _catalog()["models"][slug]
    return arch_from_hf_config(
        dict(entry["config"]), name=slug, display_name=entry["display_name"], source=entry["source"]
    )


def list_models() -> list[ModelArch]:
    """Every preset, in catalog order."""
    return [_preset(slug) for slug in _catalog()["models"]]


def aliases() -> dict[str, dict]:
    """Shorthand -> {model, why}: which real model each shorthand means."""
    return {str(k): dict(v) for k, v in (_catalog().get("aliases") or {}).items()}


def _looks_like_path(name: str) -> bool:
    return name.endswith(".json") or "/" in name or name.startswith(".") or Path(name).is_dir()


def load_config_json(path: str | Path) -> ModelArch:
    """Size a model from a local Hugging Face config.json (or a folder holding one)."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise GpuprovError(f"model config file not found: {p}")
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GpuprovError(f"{p}: not a readable JSON config ({exc.__class__.__name__}: {exc})") from None
    if not isinstance(cfg, dict):
        raise GpuprovError(f"{p}: a config.json must hold a JSON object")
    return arch_from_hf_config(cfg, name=str(path), display_name=cfg.get("_name_or_path") or p.parent.name or str(p), source=str(p))


def get_model(name_or_path: str) -> ModelArch:
    """A preset slug or shorthand (case-insensitive), or a path to a config.json."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise GpuprovError("--model is empty; give a preset name (see `gpuprov models`) or a config.json path")
    key = name_or_path.strip().lower()
    presets = _catalog()["models"]
    alias = _aliases()
    if key in alias:
        return _preset(alias[key])
    if key in presets:
        return _preset(key)
    if _looks_like_path(name_or_path):
        return load_config_json(name_or_path)
    known = list(presets) + list(alias)
    close = difflib.get_close_matches(key, known, n=4, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see `gpuprov models`"
    raise GpuprovError(f"unknown model {name_or_path!r}{hint} (or pass a path to a config.json)")
