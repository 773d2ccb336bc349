"""Model presets (data/models.yaml) and local config.json files, as ModelArch."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from pathlib import Path

from gpuprov.catalog import load_data
from gpuprov.errors import GpuprovError, clip
from gpuprov.sizing.arch import ModelArch, arch_from_hf_config


def _catalog() -> dict:
    return load_data("models.yaml")


# Models pinned to a config for the duration of a `check`: the bundle's plan.json carries the
# config.json it was sized from, so a CI job without the Hugging Face cache rebuilds the same plan.
_PINNED: dict[str, tuple[dict, str, str]] = {}


@contextlib.contextmanager
def pinned_model(name: str, config: dict, display_name: str, source: str):
    """Within the block, get_model(name) builds the model from `config` (plan.json's model.hf_config)."""
    arch_from_hf_config(dict(config), name=name, display_name=display_name, source=source)  # refuse bad ones now
    _PINNED[name] = (json.loads(json.dumps(config)), display_name, source)
    try:
        yield
    finally:
        _PINNED.pop(name, None)


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
    try:
        return name.endswith(".json") or "/" in name or name.startswith(".") or Path(name).is_dir()
    except OSError:  # a name longer than the filesystem allows is not a folder
        return False


MAX_CONFIG_BYTES = 16 << 20  # config.json files are a few KiB; some carry long vocab lists
MAX_CONFIG_DEPTH = 32  # config.json nests two or three levels (rope_scaling, quantization_config)
MAX_INT_DIGITS = 100  # a count needs at most 20 digits; longer is a bad file, not a model


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _check_tree(node: object, where: Path, depth: int = 0) -> None:
    """Nesting and text limits the JSON parser does not apply itself."""
    if depth > MAX_CONFIG_DEPTH:
        raise GpuprovError(f"{where}: nested more than {MAX_CONFIG_DEPTH} levels deep; not a model config")
    if isinstance(node, str):
        if any(0xD800 <= ord(ch) <= 0xDFFF for ch in node):
            raise GpuprovError(f"{where}: a string holds a lone surrogate ({node[:30]!r}); not valid Unicode")
    elif isinstance(node, dict):
        for key, value in node.items():
            _check_tree(key, where, depth + 1)
            _check_tree(value, where, depth + 1)
    elif isinstance(node, list):
        for value in node:
            _check_tree(value, where, depth + 1)


def read_config_json(p: Path) -> dict:
    """A config.json as a dict, within the size, depth and number limits; one-line errors."""
    from gpuprov.safefile import read_bytes

    # a FIFO or device named config.json (a crafted cache) is refused, never read
    data = read_bytes(p, limit=MAX_CONFIG_BYTES, follow=True, what="model config")
    try:
        cfg = json.loads(data.decode("utf-8"), parse_int=_parse_int, parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise GpuprovError(f"{p}: not UTF-8 text") from None
    except RecursionError:
        raise GpuprovError(f"{p}: nested too deeply; not a model config") from None
    except ValueError as exc:  # JSONDecodeError included
        raise GpuprovError(f"{p}: not a readable JSON config ({str(exc).splitlines()[0]})") from None
    if not isinstance(cfg, dict):
        raise GpuprovError(f"{p}: a config.json must hold a JSON object")
    _check_tree(cfg, p)
    return cfg


def model_from_config(cfg: dict, *, name: str, display_name: str, source: str) -> ModelArch:
    """A model from an already parsed config.json (a Plan's `model.hf_config`), within the same limits."""
    _check_tree(cfg, Path(name))
    return arch_from_hf_config(cfg, name=name, display_name=display_name, source=source)


def _display_name(cfg: dict, p: Path) -> str | None:
    """config.json `_name_or_path` (None when absent): checked, since it reaches file comments."""
    from gpuprov.validators import display_name

    if "_name_or_path" not in cfg or cfg["_name_or_path"] in (None, ""):
        return None
    value, what = cfg["_name_or_path"], f"{p}: _name_or_path"
    try:
        return display_name(value, what)
    except ValueError as exc:
        raise GpuprovError(str(exc)) from None


def load_config_json(path: str | Path) -> ModelArch:
    """Size a model from a local Hugging Face config.json (or a folder holding one)."""
    p = Path(path).expanduser()
    try:
        if p.is_dir():
            p = p / "config.json"
        found = p.is_file()
    except OSError as exc:  # a name too long, a symlink loop
        raise GpuprovError(f"model config {str(p)[:80]!r}: {exc.strerror or type(exc).__name__}") from None
    if not found:
        raise GpuprovError(f"model config file not found: {p}")
    cfg = read_config_json(p)
    display = _display_name(cfg, p)
    if display is None:  # named from what the config says (type and size), never from its folder
        kind = _display_name({"_name_or_path": _config_kind(cfg)}, p)
        size = arch_from_hf_config(cfg, name=str(path), display_name=kind, source=str(p)).params / 1e9
        display = f"{kind} {size:.1f}B"
    return arch_from_hf_config(cfg, name=str(path), display_name=display, source=str(p))


def _config_kind(cfg: dict) -> str:
    archs = cfg.get("architectures")
    first = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    kind = first or cfg.get("model_type")
    return kind if isinstance(kind, str) and kind else "model"


def resolve_model_ref(name: str, base: Path) -> str:
    """A relative config.json path as an absolute one, resolved against `base` (the spec file's
    folder, or the current directory for a flag); preset names as they are. The lock then holds a
    path that works from any directory."""
    key = name.strip().lower()
    if key in _catalog()["models"] or key in _aliases():
        return name
    path = Path(name).expanduser()
    try:
        # DIR/config.json is a path even where it does not exist (its error names the absolute path);
        # read as an id it would be looked up relative to whatever folder gpuprov runs in
        if HF_ID.match(name) and not name.endswith(".json") and not (base / path).exists():
            return name  # a Hugging Face model id, read from the cache or the hub
        looks = name.endswith(".json") or "/" in name or name.startswith(".") or (base / path).is_dir()
        if path.is_absolute() or not looks:
            return name
    except (OSError, ValueError):
        return name  # the validators report what is wrong with it
    return os.path.normpath(os.path.abspath(base / path))


HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def _hf_cache_dir() -> Path:
    """Where huggingface_hub keeps downloads: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _cached_config(repo_id: str) -> Path | None:
    """config.json of `repo_id` in the local cache: the snapshot refs/main names, else the newest one."""
    from gpuprov.safefile import read_text

    repo = _hf_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        commit = read_text(ref, limit=4096, follow=True, what="Hugging Face ref").strip()
        if not _COMMIT.fullmatch(commit):  # it names a folder: never a path of its own
            raise GpuprovError(f"{ref}: expected a commit hash (4 to 64 hex digits), got {commit[:50]!r}")
        pinned = repo / "snapshots" / commit / "config.json"
        if pinned.exists():  # read_config_json refuses what is not a regular file
            return pinned
    found = sorted((p for p in repo.glob("snapshots/*/config.json") if p.exists()), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


_COMMIT = re.compile(r"[0-9a-f]{4,64}")  # a git commit id (SHA-1 or SHA-256), full or abbreviated


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
                           f"hub did not serve its config.json ({exc.__class__.__name__}: {clip(str(exc).splitlines()[0], 160)})"
                           ) from None


def load_hf_model(repo_id: str) -> ModelArch | None:
    """A Hugging Face model id, sized from its config.json (local cache first, then the hub)."""
    path = _cached_config(repo_id) or _downloaded_config(repo_id)
    if path is None:
        return None
    cfg = read_config_json(path)
    # the snapshot folder is the commit the config is from; no local path (the plan stays portable)
    revision = path.parent.name if path.parent.parent.name == "snapshots" else "main"
    return arch_from_hf_config(cfg, name=repo_id, display_name=repo_id,
                               source=f"huggingface.co/{repo_id}/blob/{revision}/config.json")


def preset_of_repo(repo_id: str) -> str | None:
    """The preset whose hf_repo, or one of whose hf_ids (its instruct, chat and post-trained releases), is
    this Hugging Face id (case-insensitive, as the hub treats ids)."""
    want = repo_id.strip().lower()
    for slug, e in _catalog()["models"].items():
        if want in [str(i).lower() for i in [e.get("hf_repo", ""), *(e.get("hf_ids") or [])]]:
            return slug
    return None


def weights_source(name_or_path: str) -> str:
    """Where a model's pretrained weights come from: its Hugging Face id, or the directory of its config.json."""
    key = name_or_path.strip().lower()
    slug = _aliases().get(key, key)
    entry = _catalog()["models"].get(slug)
    if entry is not None:
        return str(entry["hf_repo"])
    if HF_ID.match(name_or_path) and not Path(name_or_path).expanduser().exists():
        return name_or_path
    path = Path(name_or_path)
    return str(path.parent if path.name == "config.json" or path.suffix == ".json" else path)


def get_model(name_or_path: str) -> ModelArch:
    """A preset slug or shorthand (case-insensitive), a Hugging Face model id (ORG/NAME), or a config.json path."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise GpuprovError("--model is empty; give a preset name (see `gpuprov models`) or a config.json path")
    if name_or_path in _PINNED:  # built fresh each call: transformers rewrites nested dicts in place
        config, display_name, source = _PINNED[name_or_path]
        return arch_from_hf_config(json.loads(json.dumps(config)), name=name_or_path, display_name=display_name,
                                   source=source)
    key = name_or_path.strip().lower()
    presets = _catalog()["models"]
    alias = _aliases()
    if key in alias:
        return _preset(alias[key])
    if key in presets:
        return _preset(key)
    if HF_ID.match(name_or_path) and not Path(name_or_path).expanduser().exists():
        preset = preset_of_repo(name_or_path)
        if preset is not None:  # the preset's config is that repo's config.json, verbatim: no cache needed
            arch = _preset(preset)
            same = name_or_path.lower() == str(_catalog()["models"][preset]["hf_repo"]).lower()
            # an instruct / chat release of the preset's architecture: named as the id the weights come from
            return arch if same else dataclasses.replace(arch, display_name=name_or_path)
        loaded = load_hf_model(name_or_path)
        if loaded is not None:
            return loaded
        raise GpuprovError(f"--model {name_or_path}: not a preset, and not in the local Hugging Face cache "
                           f"({_hf_cache_dir()}); pip install huggingface_hub to fetch its config.json, or pass "
                           "a config.json path")
    if _looks_like_path(name_or_path):
        return load_config_json(name_or_path)
    known = list(presets) + list(alias)
    import difflib  # lazy: only a name the catalog lacks needs it
    close = difflib.get_close_matches(key, known, n=4, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see `gpuprov models`"
    raise GpuprovError(f"unknown model {name_or_path!r}{hint} (or pass a path to a config.json)")
