"""Model presets (data/models.yaml) and local config.json files, as ModelArch."""

from __future__ import annotations

import difflib
import json
import os
import re
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
    return _from_config(cfg, name=str(path), source=str(p))


def _from_config(cfg: dict, *, name: str, source: str, display_name: str | None = None) -> ModelArch:
    """A ModelArch named from what the config says (its _name_or_path, else type and size), not its folder."""
    arch = arch_from_hf_config(cfg, name=name, display_name=display_name or cfg.get("_name_or_path") or None,
                               source=source)
    if display_name or cfg.get("_name_or_path"):
        return arch
    kind = (cfg.get("architectures") or [None])[0] or cfg.get("model_type") or "model"
    return arch_from_hf_config(cfg, name=name, display_name=f"{kind} {arch.params / 1e9:.1f}B", source=source)


HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def _hf_cache_dir() -> Path:
    """Where huggingface_hub keeps downloads: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _cached_config(repo_id: str) -> Path | None:
    """config.json of `repo_id` in the local cache: the snapshot refs/main names, else the newest one."""
    repo = _hf_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        pinned = repo / "snapshots" / ref.read_text(encoding="utf-8").strip() / "config.json"
        if pinned.is_file():
            return pinned
    found = sorted(repo.glob("snapshots/*/config.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _downloaded_config(repo_id: str) -> Path | None:
    """Fetch only config.json with huggingface_hub when it is installed (None when it is not)."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        return None
    try:
        return Path(hf_hub_download(repo_id=repo_id, filename="config.json"))
    except Exception as exc:  # offline, gated, no such repo: one line, whatever the hub raised
        raise GpuprovError(f"--model {repo_id}: not in the local Hugging Face cache ({_hf_cache_dir()}) and the "
                           f"hub did not serve its config.json ({exc.__class__.__name__}: {str(exc).splitlines()[0][:160]})"
                           ) from None


def load_hf_model(repo_id: str) -> ModelArch | None:
    """A Hugging Face model id, sized from its config.json (local cache first, then the hub)."""
    path = _cached_config(repo_id) or _downloaded_config(repo_id)
    if path is None:
        return None
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GpuprovError(f"{path}: not a readable JSON config ({exc.__class__.__name__}: {exc})") from None
    if not isinstance(cfg, dict):
        raise GpuprovError(f"{path}: a config.json must hold a JSON object")
    return _from_config(cfg, name=repo_id, display_name=repo_id, source=f"huggingface.co/{repo_id} config.json ({path})")


def get_model(name_or_path: str) -> ModelArch:
    """A preset slug or shorthand (case-insensitive), a Hugging Face model id (ORG/NAME), or a config.json path."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise GpuprovError("--model is empty; give a preset name (see `gpuprov models`) or a config.json path")
    key = name_or_path.strip().lower()
    presets = _catalog()["models"]
    alias = _aliases()
    if key in alias:
        return _preset(alias[key])
    if key in presets:
        return _preset(key)
    if HF_ID.match(name_or_path) and not Path(name_or_path).expanduser().exists():
        arch = load_hf_model(name_or_path)
        if arch is not None:
            return arch
        raise GpuprovError(f"--model {name_or_path}: not a preset, and not in the local Hugging Face cache "
                           f"({_hf_cache_dir()}); pip install huggingface_hub to fetch its config.json, or pass "
                           "a config.json path")
    if _looks_like_path(name_or_path):
        return load_config_json(name_or_path)
    known = list(presets) + list(alias)
    close = difflib.get_close_matches(key, known, n=4, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see `gpuprov models`"
    raise GpuprovError(f"unknown model {name_or_path!r}{hint} (or pass a path to a config.json)")
