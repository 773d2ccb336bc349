"""Catalogs: YAML data files under `data/`, every figure with a `source:`.

Loaders per catalog live beside this file (`models.py`, `gpus.py`, `instances.py`,
`fabrics.py`); this module holds what they share.

Parsing: libyaml through PyYAML's CSafeLoader (about ten times faster than a pure-Python parser;
`gpuprov plan` parses every catalog on each run), taught the YAML 1.2 core schema the catalogs are
written in (`1.0e9` is a float, `yes`/`on` are strings) and to refuse duplicate keys, so it reads
exactly what ruamel.yaml's safe loader reads. Without libyaml (or PyYAML) ruamel.yaml parses.
tests/test_fabric_catalog.py holds the two to the same result, type for type, on every file. The tree
itself is built from the loader's parser events (yaml_events.py: the loader's tree in one pass), the
loader building what that pass leaves to it.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from typing import Any

from gpuprov.resources import catalog_data_dir

# YAML 1.2 core-schema scalars, as ruamel.yaml's VersionedResolver resolves them for version 1.2
_IMPLICIT_1_2: tuple[tuple[str, str, str | tuple[str, ...]], ...] = (
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("tag:yaml.org,2002:float", r"""^(?:
         [-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |[-+]?\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""", "-+0123456789."),
    ("tag:yaml.org,2002:int", r"""^(?:[-+]?0b[0-1_]+
        |[-+]?0o?[0-7_]+
        |[-+]?[0-9_]+
        |[-+]?0x[0-9a-fA-F_]+)$""", "-+0123456789"),
    ("tag:yaml.org,2002:merge", r"^(?:<<)$", "<"),
    ("tag:yaml.org,2002:null", r"^(?: ~ |null|Null|NULL | )$", ("~", "n", "N", "")),
    ("tag:yaml.org,2002:timestamp", r"""^(?:[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]
        |[0-9][0-9][0-9][0-9] -[0-9][0-9]? -[0-9][0-9]?
        (?:[Tt]|[ \t]+)[0-9][0-9]?
        :[0-9][0-9] :[0-9][0-9] (?:\.[0-9]*)?
        (?:[ \t]*(?:Z|[-+][0-9][0-9]?(?::[0-9][0-9])?))?)$""", "0123456789"),
)


@lru_cache(maxsize=None)
def _fast_loader() -> Any:
    """A PyYAML CSafeLoader with the YAML 1.2 core schema and duplicate-key errors; None without libyaml."""
    try:
        import yaml
        from yaml import CSafeLoader
    except ImportError:
        return None

    class CatalogLoader(CSafeLoader):  # type: ignore[misc, valid-type]
        yaml_implicit_resolvers: dict = {}

        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            if isinstance(node, yaml.MappingNode):
                seen: set = set()
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                        continue
                    key = (key_node.tag, key_node.value)
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            "while constructing a mapping", node.start_mark,
                            f"found duplicate key {key_node.value!r}", key_node.start_mark)
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)

        def construct_yaml_int(self, node: Any) -> int:
            # 1.2: 0o17 is octal, 017 is decimal (PyYAML's 1.1 constructor reads 017 as octal)
            value = str(self.construct_scalar(node)).replace("_", "")
            sign = -1 if value.startswith("-") else 1
            digits = value.lstrip("+-")
            for prefix, base in (("0b", 2), ("0x", 16), ("0o", 8)):
                if digits.startswith(prefix):
                    return sign * int(digits[2:], base)
            return sign * int(digits)

    CatalogLoader.add_constructor("tag:yaml.org,2002:int", CatalogLoader.construct_yaml_int)
    for tag, pattern, first in _IMPLICIT_1_2:
        CatalogLoader.add_implicit_resolver(tag, re.compile(pattern, re.X), list(first))
    return CatalogLoader


def parse_yaml(text: str, *, fast: bool = True) -> Any:
    """Safe-load one YAML document: libyaml when PyYAML has it (fast), else pure-Python ruamel.yaml."""
    loader = _fast_loader() if fast else None
    if loader is not None:
        import yaml

        from gpuprov.catalog import yaml_events

        try:
            return yaml_events.load(text, loader)  # the same tree, built from the parser's events in one pass
        except yaml_events.Unbuilt:
            return yaml.load(text, Loader=loader)  # noqa: S506 - a CSafeLoader subclass
    from ruamel.yaml import YAML

    return YAML(typ="safe", pure=True).load(text)


@lru_cache(maxsize=None)
def load_data(filename: str) -> Any:
    """Parse one catalog file (safe loader; cached: catalogs are read-only at run time)."""
    path = catalog_data_dir() / filename
    return cached_parse(path.read_text(encoding="utf-8"))


def cached_parse(text: str) -> Any:
    """parse_yaml(text), kept in the user's cache folder (usercache.py) under the hash of the text and of this
    module (its schema rules): the next run reads the parsed tree back instead of parsing the file again.
    marshal, not pickle: built in (nothing to import) and it builds only plain values, which is all a
    catalog holds; a tree it cannot write (a YAML timestamp) is parsed on every run instead."""
    import marshal

    from gpuprov.usercache import cache_dir, write_atomic

    folder = cache_dir("catalog")
    if folder is None:
        return parse_yaml(text)
    digest = hashlib.sha256(_parser_tag().encode() + text.encode("utf-8")).hexdigest()
    entry = folder / f"{digest[:40]}.marshal"
    try:
        found = marshal.loads(entry.read_bytes())
        if isinstance(found, tuple) and len(found) == 2 and found[0] == digest:
            return found[1]
    except Exception:  # noqa: BLE001 - absent, truncated or foreign: parse afresh
        pass
    data = parse_yaml(text)
    try:
        write_atomic(entry, marshal.dumps((digest, data)))
    except ValueError:  # a value marshal does not write
        pass
    return data


@lru_cache(maxsize=None)
def _parser_tag() -> str:
    """What else a parsed tree depends on: this module's parsing rules and yaml_events.py, which builds the tree
    (libyaml and ruamel.yaml read the same tree, tests/test_fabric_catalog.py)."""
    from pathlib import Path

    here = Path(__file__)
    return hashlib.sha256(here.read_bytes() + b"\0" + (here.parent / "yaml_events.py").read_bytes()).hexdigest()


@lru_cache(maxsize=None)
def catalog_version() -> str:
    """Content hash of every catalog file, recorded in plans and locks (drift in data shows)."""
    digest = hashlib.sha256()
    for path in sorted(catalog_data_dir().glob("*.yaml")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
