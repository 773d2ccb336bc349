"""Read a spec (gpuprov.yaml), a hosts list, and unit-suffixed numbers into a TrainingSpec.

Every failure becomes one GpuprovError line that names the file and line where it can
(`gpuprov.yaml:7: tokens: ...`): users fix specs in editors, and CI logs show one line.
Command-line values override file values key by key (`build_spec(file_data, overrides)`).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from gpuprov.errors import GpuprovError

# decimal for token counts (20B tokens = 2e10), as papers and model cards write them
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
# binary for batch sizes: a "4M" batch is 2**22 tokens (1024 x 4096), which divides into sequences
_BINARY = {"": 1, "k": 2**10, "m": 2**20, "b": 2**30, "g": 2**30, "t": 2**40}
_COUNT = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)(i?)\s*$")
_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)\s*$")
_HOURS_PER = {"s": 1 / 3600, "m": 1 / 60, "h": 1, "": 1, "d": 24, "w": 168}

# spec keys whose values may carry units, in files as on the command line
UNIT_KEYS = {"tokens": "decimal", "global_batch_tokens": "binary", "deadline_hours": "duration"}


def parse_count(value: Any, *, binary: bool = False, what: str = "value") -> int:
    """'20B' -> 20_000_000_000; with binary=True '4M' -> 4_194_304. 'Ki/Mi' suffixes are always binary."""
    if isinstance(value, bool):
        raise GpuprovError(f"{what}: expected a number like 20B or 4M, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise GpuprovError(f"{what}: expected a whole number, got {value!r}")
        return int(value)
    match = _COUNT.match(str(value))
    if not match:
        raise GpuprovError(f"{what}: expected a number like 20B, 1T or 4M, got {value!r}")
    number, suffix, binary_marker = match.groups()
    table = _BINARY if (binary or binary_marker) else _DECIMAL
    scaled = float(number.replace("_", "")) * table[suffix.lower()]
    if not math.isfinite(scaled) or scaled != int(scaled):
        raise GpuprovError(f"{what}: {value!r} is not a whole number")
    return int(scaled)


def parse_hours(value: Any, *, what: str = "deadline") -> float:
    """'30d' -> 720.0, '12h' -> 12.0, '90m' -> 1.5; a bare number is hours."""
    if isinstance(value, bool):
        raise GpuprovError(f"{what}: expected a duration like 30d or 12h, got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise GpuprovError(f"{what}: expected a finite duration, got {value!r}")
        return float(value)
    match = _DURATION.match(str(value))
    if not match:
        raise GpuprovError(f"{what}: expected a duration like 30d, 12h or 90m, got {value!r}")
    number, unit = match.groups()
    hours = float(number) * _HOURS_PER[unit]
    if not math.isfinite(hours):
        raise GpuprovError(f"{what}: {value!r} is out of range")
    return hours


def apply_units(data: dict[str, Any], where: dict[str, str] | None = None) -> dict[str, Any]:
    """Convert unit-suffixed values of UNIT_KEYS in place; `where` names each key's origin for errors."""
    where = where or {}
    for key, kind in UNIT_KEYS.items():
        if key not in data or data[key] is None:
            continue
        what = where.get(key, key)
        if kind == "duration":
            data[key] = parse_hours(data[key], what=what)
        else:
            data[key] = parse_count(data[key], binary=kind == "binary", what=what)
    return data


def _yaml_error_line(path: Path, exc: Exception) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
    return f"{where}: invalid YAML: {problem}"


MAX_FILE_BYTES = 1 << 20  # a spec or hosts file is a few KiB; a megabyte is already absurd
MAX_DEPTH = 32  # nesting of mappings/lists a spec may have (it needs 3)
MAX_VALUES = 100_000  # scalars after YAML aliases are expanded (an alias bomb expands to billions)


def read_text(path: str | Path) -> str:
    """A small UTF-8 regular file (a FIFO or device is refused, never read), or one GpuprovError line."""
    from gpuprov.safefile import read_text as read_guarded

    return read_guarded(path, limit=MAX_FILE_BYTES, follow=True, what="spec or hosts file")


def load_yaml(path: str | Path, text: str | None = None) -> Any:
    """One bounded pass (yamlload: libyaml's events built into dicts and lists that carry line
    numbers for error messages); one-line errors; bounded size, depth, values and keys."""
    import yaml

    from gpuprov.yamlload import YamlError, load

    path = Path(path)
    text = read_text(path) if text is None else text
    try:
        _check_flow_depth(text, path)  # before the scanner, whose cost grows with the square of it
        return load(text, max_depth=MAX_DEPTH, max_values=MAX_VALUES)
    except YamlError as exc:
        raise GpuprovError(f"{path}:{exc.line + 1}: {exc}") from None
    except yaml.YAMLError as exc:
        raise GpuprovError(_yaml_error_line(path, exc)) from None
    except (ValueError, TypeError, RecursionError, OverflowError) as exc:  # odd scalars: `0b`, `1_e5`
        raise GpuprovError(f"{path}: invalid YAML: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


_OPENS_SCALAR = set("[{,:-?")
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")  # a quote after one of these (or at a line's start) begins a quoted scalar


def _check_flow_depth(text: str, path: Path) -> None:
    """Flow nesting (`[`, `{`) from the raw text: the YAML scanner keeps one possible key per open
    flow level and rescans them all at every token, so 5,000 `[` take seconds before any event.
    Quotes count only where a quoted scalar can start, and end at the line (spec and hosts values
    are one line), so a stray quote cannot hide the brackets after it."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return
    depth = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if "[" not in line and "{" not in line and depth == 0:
            continue
        if "'" not in line and '"' not in line and "#" not in line:
            line = _NOT_BRACKET.sub("", line)  # only brackets count on this line: scan just those
        quote, previous = "", ""
        for index, ch in enumerate(line):
            if quote:
                if ch == quote and not (quote == '"' and _escaped(line, index)):
                    quote = ""
                continue
            if ch in "'\"" and (previous == "" or previous in _OPENS_SCALAR):
                quote = ch
            elif ch == "#" and (index == 0 or line[index - 1].isspace()):
                break
            elif ch in "[{":
                depth += 1
                if depth > MAX_DEPTH:
                    raise GpuprovError(f"{path}:{number}: nested more than {MAX_DEPTH} levels deep")
            elif ch in "]}":
                depth = max(0, depth - 1)
            if not ch.isspace():
                previous = ch


def _escaped(line: str, index: int) -> bool:
    backslashes = len(line[:index]) - len(line[:index].rstrip("\\"))
    return backslashes % 2 == 1


def _line_of(node: Any, loc: tuple) -> int | None:
    """1-based line of the deepest key/item of `loc` found in a ruamel round-trip tree."""
    line = None
    for part in loc:
        lc = getattr(node, "lc", None)
        try:
            if isinstance(part, int) and isinstance(node, list):
                if lc is not None:
                    line = lc.item(part)[0] + 1
                node = node[part]
            elif isinstance(node, dict) and part in node:
                if lc is not None:
                    line = lc.key(part)[0] + 1
                node = node[part]
            else:
                break
        except (KeyError, IndexError, TypeError, AttributeError):
            break
    return line


def _plain(node: Any) -> Any:
    """ruamel round-trip containers -> plain dict/list/scalars (pydantic sees ordinary types)."""
    if isinstance(node, dict):
        return {(str(k) if not isinstance(k, (str, int, float, bool)) or k is None else k): _plain(v)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_plain(v) for v in node]
    if isinstance(node, str):
        return str(node)
    if isinstance(node, bool) or node is None:
        return node
    if isinstance(node, int):
        return int(node)
    if isinstance(node, float):
        return float(node)
    return str(node)  # dates, timestamps: let the model reject them with its own message


def _show(part: Any) -> str:
    """A key as the user wrote it, quoted when it is not a plain name (keeps the message one line)."""
    text = str(part)
    return text if re.fullmatch(r"[\w.-]{1,60}", text) else repr(text[:60])


# Spellings of an idea that are not its spec key (the flag's own name, or a common alias) -> the key and
# what to write: an unknown key with one of these names gets that hint, not only "unknown key".
OTHER_SPELLINGS: dict[str, tuple[str, str]] = {
    "gpu": ("gpus", "a list of GPU types, what --gpu takes: gpus: [h100-80gb]"),
    "gpu_type": ("gpus", "a list of GPU types, what --gpu takes: gpus: [h100-80gb]"),
    "gpu_types": ("gpus", "a list of GPU types, what --gpu takes: gpus: [h100-80gb]"),
    "num_gpus": ("gpu_count", "the GPUs in total, what --gpus takes: gpu_count: 8"),
    "deadline": ("deadline_hours", "what --deadline takes: deadline_hours: 48 (or 30d, 12h)"),
    "budget": ("budget_usd", "what --budget takes: budget_usd: 50000"),
    "from_scratch": ("init", "what --from-scratch sets: init: random"),
    "batch_tokens": ("global_batch_tokens", "what --batch-tokens takes: global_batch_tokens: 4M"),
    "nodes": ("max_nodes", "the largest node count, what --max-nodes takes: max_nodes: 4"),
    "spot": ("purchase", "the allowed purchase options, what --purchase takes: purchase: [spot]"),
}


def _unknown_key(key: object) -> str:
    other = OTHER_SPELLINGS.get(str(key).replace("-", "_").lower())
    if other is None:
        return "unknown key (see `gpuprov schema`)"
    return f"unknown key: write {other[0]}: ({other[1]})"


def format_validation_error(exc: Any, *, prefix: str = "", tree: Any = None,
                            names: dict[str, str] | None = None) -> str:
    """A pydantic ValidationError as one line: 'file:line: field: message; ...' (first three errors)."""
    parts = []
    errors = exc.errors(include_url=False)
    for error in errors[:3]:
        loc = tuple(error.get("loc", ()))
        # drop pydantic's union-branch markers (e.g. 'list[str]') so the path reads like the file
        loc = tuple(p for p in loc if isinstance(p, int) or not re.search(r"[\[\]]", str(p)))
        field = ".".join(_show(p) for p in loc) or "spec"
        if names and loc and loc[0] in names:
            field = names[loc[0]] + "".join(f".{_show(p)}" for p in loc[1:])
        message = error.get("msg", "invalid").removeprefix("Value error, ")
        if error.get("type") == "extra_forbidden":
            message = _unknown_key(loc[-1] if loc else "")
        line = _line_of(tree, loc) if tree is not None else None
        where = f"{prefix}:{line}: " if prefix and line else (f"{prefix}: " if prefix else "")
        parts.append(f"{where}{field}: {message}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return ("; ".join(parts) + more).replace("\r", "\\r").replace("\n", "\\n")


def load_spec_data(path: str | Path) -> tuple[dict[str, Any], Any]:
    """(plain dict with units converted, the ruamel tree for line numbers)."""
    path = Path(path)
    tree = load_yaml(path)
    if tree is None:
        return {}, None
    if not isinstance(tree, dict):
        raise GpuprovError(f"{path}: expected a mapping of spec keys (model: ..., tokens: ...), "
                           f"got {type(_plain(tree)).__name__}")
    if "lock_format" in tree and isinstance(tree.get("spec"), dict):
        tree = tree["spec"]  # a gpuprov.lock holds the full spec: `generate -f infra/gpuprov.lock`
    data = _plain(tree)
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise GpuprovError(f"{path}:{_line_of(tree, (bad[0],)) or 1}: key {bad[0]!r} must be a name")
    where = {k: f"{path}:{_line_of(tree, (k,)) or 1}: {k}" for k in UNIT_KEYS}
    return apply_units(data, where), tree


def build_spec(file_data: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None, *,
               source: str | None = None, tree: Any = None, flag_names: dict[str, str] | None = None):
    """File values, then command-line overrides, validated into one TrainingSpec."""
    from pydantic import ValidationError

    from gpuprov.spec import TrainingSpec

    data = dict(file_data or {})
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    data.update(overrides)
    from gpuprov.validators import MAX_HOSTS

    long = next((k for k, value in data.items() if isinstance(value, (list, dict)) and len(value) > MAX_HOSTS), None)
    if long is not None:  # no spec list is that long; validating each item of one only to refuse it costs seconds
        line = _line_of(tree, (long,)) if tree is not None and long not in overrides else None
        where = f"{source}:{line}: " if source and line else (f"{source}: " if source else "")
        raise GpuprovError(f"{where}{_show(long)}: more than {MAX_HOSTS:,} items")
    if isinstance(data.get("model"), str) and data["model"].strip():
        # a path in a file is relative to that file; on the command line, to the current directory
        base = Path.cwd() if "model" in overrides or not source else Path(source).absolute().parent
        data["model"] = _resolve_model(data["model"], base)
    if isinstance(data.get("dataset"), str) and data.get("dataset_tokens") is None and data["dataset"].strip():
        # a data file named in a spec file is relative to that file (counted here, where the base is known)
        base = Path.cwd() if "dataset" in overrides or not source else Path(source).absolute().parent
        size = _dataset_size(data["dataset"], base, data.get("model"))
        data["dataset_tokens"] = size.tokens if size else None
        if size is not None and size.tokens is not None and data.get("dataset_tokens_how") is None:
            data["dataset_tokens_how"] = size.how  # kept in the lock: a regeneration reads no file for it
        if size is not None and size.sample is not None and data.get("sample_tokens") is None:
            data["sample_tokens"], data["sample_tokens_how"] = round(size.sample.mean_tokens, 1), size.sample.how
        data["dataset"] = _absolute_dataset(data["dataset"], base)
    for key, value in data.items():
        # inf/nan pass pydantic's gt=0 checks but mean nothing as a budget or margin (and are not JSON)
        if isinstance(value, float) and not math.isfinite(value):
            where = flag_names.get(key, key) if key in overrides and flag_names else key
            line = _line_of(tree, (key,)) if key not in overrides else None
            prefix = f"{source}:{line}: " if source and line else (f"{source}: " if source and key not in overrides else "")
            raise GpuprovError(f"{prefix}{_show(where)}: expected a finite number, got {value!r}")
    try:
        return TrainingSpec.model_validate(data)
    except ValidationError as exc:
        # errors on overridden keys come from flags, the rest from the file
        first = exc.errors(include_url=False)[0]
        failed = first["loc"][0] if first.get("loc") else None
        if failed in overrides:
            raise GpuprovError(format_validation_error(exc, names=flag_names)) from None
        raise GpuprovError(format_validation_error(exc, prefix=source or "", tree=tree)) from None


def _absolute_dataset(value: str, base: Path) -> str:
    """A local data file as an absolute path (`up` copies it from there, wherever it runs), like a
    model's config.json; a token count or a remote source as given."""
    from gpuprov.validators import dataset_scheme

    text = value.strip()
    if dataset_scheme(text) is not None or not (base / text).exists() or Path(text).is_absolute():
        return value  # a count, a remote source, or a path that needs no base
    return str((base / text).absolute())


def _dataset_size(value: str, base: Path, model: Any = None) -> Any:
    """recipes.DatasetSize of --dataset (None: left for the validator's one-line error)."""
    from gpuprov.recipes import dataset_tokens

    if len(value) > 4096 or (not value.isprintable() and any(ord(ch) < 32 for ch in value)) \
            or len(value.encode("utf-8", "surrogatepass")) > 4096:
        return None  # left for the validator's one-line error
    return dataset_tokens(value, base, model if isinstance(model, str) else None)


def _resolve_model(model: str, base: Path) -> str:
    from gpuprov.catalog.models import resolve_model_ref

    if len(model) > 4096 or (not model.isprintable() and any(ord(ch) < 32 for ch in model)) \
            or len(model.encode("utf-8", "surrogatepass")) > 4096:
        return model  # left for the validator's one-line error
    return resolve_model_ref(model, base)


def load_spec(path: str | Path, overrides: dict[str, Any] | None = None):
    data, tree = load_spec_data(path)
    return build_spec(data, overrides, source=str(path), tree=tree)


_INI_HOST = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\s+(.*))?$")


# host variables gpuprov carries into the bundle; any other is refused, never dropped without a word
_UNREAD = ("is not read by gpuprov (it reads ansible_host, ansible_user, ansible_port); set other Ansible "
           "variables in the bundle's ansible/group_vars")


def _hosts_from_ini(path: Path, text: str) -> list[dict[str, Any]]:
    """Ansible-style ini: `name ansible_host=10.0.0.1 ansible_user=ubuntu`, or `name address`."""
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].split(";", 1)[0].strip()
        if not line or (line.startswith("[") and line.endswith("]")):
            continue
        match = _INI_HOST.match(line)
        if not match:
            raise GpuprovError(f"{path}:{number}: expected `name ansible_host=ADDRESS`, got {raw.strip()!r}")
        name, rest = match.group(1), (match.group(2) or "").split()
        entry: dict[str, Any] = {"name": name}
        for token in rest:
            if "=" in token:
                key, _, value = token.partition("=")
                if key in ("ansible_host", "address"):
                    entry["address"] = value
                elif key in ("ansible_user", "user"):
                    entry["user"] = value
                elif key in ("ansible_port", "port"):
                    entry["port"] = value
                else:  # dropped silently, a port or key file would be lost between this file and the bundle
                    raise GpuprovError(f"{path}:{number}: host variable {key!r} {_UNREAD}")
            elif "address" not in entry:
                entry["address"] = token
        entry.setdefault("address", name)  # a bare name resolves through DNS, as in Ansible
        hosts.append(entry)
    return hosts


def _looks_like_ini(path: Path, text: str) -> bool:
    """An .ini name, a `[group]` header line, or `key=value` host variables: not YAML."""
    if path.suffix in (".ini", ".cfg"):
        return True
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith(("#", ";"))]
    return bool(lines) and (re.match(r"^\[[A-Za-z0-9_:-]+\]$", lines[0]) is not None
                            or any(re.search(r"\s\w+=\S", ln) for ln in lines))


def _read_hosts(path: Path) -> tuple[str, Any, str]:
    """(format, YAML tree or None, text) of a hosts file: one read, at most one YAML load."""
    text = read_text(path)
    if _looks_like_ini(path, text):
        return "ini", None, text
    tree = load_yaml(path, text)
    if tree is None or isinstance(tree, str):
        return "ini", None, text
    return ("inventory" if "all" in tree else "mapping") if isinstance(tree, dict) else "list", tree, text


def hosts_format(path: str | Path) -> str:
    """Which of load_hosts' formats a hosts file is: "ini", "inventory", "mapping" or "list"."""
    return _read_hosts(Path(path))[0]


def load_hosts(path: str | Path) -> list:
    """Hosts file -> [HostEntry]: a YAML list of {name, address[, user]}, a YAML mapping
    name -> address, an Ansible YAML inventory (all.children.gpu_nodes.hosts), or ini lines."""
    from pydantic import ValidationError

    from gpuprov.spec import HostEntry

    path = Path(path)
    kind, tree, text = _read_hosts(path)
    if kind == "ini":
        entries = _hosts_from_ini(path, text)
        tree = None
    else:
        data = _plain(tree)
        if kind == "inventory":  # an Ansible YAML inventory
            try:
                data = data["all"]["children"]["gpu_nodes"]["hosts"]
            except (KeyError, TypeError):
                raise GpuprovError(f"{path}: an inventory must list hosts under all.children.gpu_nodes.hosts") from None
            tree = None
        if isinstance(data, dict):
            entries = []
            for name, value in data.items():
                if not isinstance(name, str):  # `0777:` is the number 777 to YAML, not the host 0777
                    raise GpuprovError(f"{path}: host name {name!r} reads as a {type(name).__name__} in YAML; "
                                       "quote it (\"0777\": 10.0.0.1)")
                if isinstance(value, dict):
                    entry = {"name": str(name), "address": value.get("ansible_host", value.get("address", name))}
                    if value.get("ansible_user") or value.get("user"):
                        entry["user"] = value.get("ansible_user") or value.get("user")
                    if value.get("ansible_port") is not None or value.get("port") is not None:
                        entry["port"] = value.get("ansible_port", value.get("port"))
                    unread = sorted(set(value) - {"ansible_host", "address", "ansible_user", "user",
                                                  "ansible_port", "port"})
                    if "private_ip" in unread and value["private_ip"] == entry["address"]:
                        unread.remove("private_ip")  # what a bundle's inventory writes: the address again
                    if unread:
                        raise GpuprovError(f"{path}: host {_show(name)}: variable {unread[0]!r} {_UNREAD}")
                else:
                    entry = {"name": str(name), "address": value if value is not None else str(name)}
                entries.append(entry)
            tree = None
        elif isinstance(data, list):
            entries = data
        else:
            raise GpuprovError(f"{path}: expected a list of hosts (- name: gpu0, address: 10.0.0.10)")
    if not entries:
        raise GpuprovError(f"{path}: lists no hosts")
    from gpuprov.validators import MAX_HOSTS

    if len(entries) > MAX_HOSTS:  # before validating each one only to refuse the list
        raise GpuprovError(f"{path}: more than {MAX_HOSTS:,} hosts")
    hosts = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise GpuprovError(f"{path}:{_line_of(tree, (index,)) or index + 1}: host {index}: "
                               f"expected name and address, got {entry!r}")
        try:
            hosts.append(HostEntry.model_validate(entry))
        except ValidationError as exc:
            raise GpuprovError(format_validation_error(exc, prefix=str(path), tree=tree[index] if tree else None)
                               .replace(f"{path}: ", f"{path}: host {index}: ", 1)) from None
    names = [h.name for h in hosts]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:
        raise GpuprovError(f"{path}: host name {duplicate!r} appears twice")
    return hosts
