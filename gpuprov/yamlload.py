"""One bounded pass over a YAML document: libyaml's parser events, built into dicts and lists here.

Why not a loader: round-trip loading is slow (a 1 MiB spec took over a minute in three passes) and
every loader's composer recurses and constructs before anything can bound the result. Building
from the event stream is linear and refuses, as it goes, nesting past `max_depth`, more than
`max_values` values once aliases are expanded (an alias bomb is refused at the budget, not
expanded), a collection as a mapping key and a duplicate key, each with its line.
Scalars resolve by the YAML 1.2 core schema, as ruamel's default loader does (`yes` and `0777`
are the string "yes" and the number 777, never a boolean or an octal).
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml

_PARSER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's C parser where installed

# YAML 1.2 core schema (ruamel.yaml's 1.2 resolver), keyed by first character
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                      |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                      |[-+]?\.[0-9_]+(?:[eE][-+][0-9]+)?
                      |[-+]?\.(?:inf|Inf|INF)
                      |\.(?:nan|NaN|NAN))$""", re.X)
_INT = re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0o?[0-7_]+|[-+]?[0-9_]+|[-+]?0x[0-9a-fA-F_]+)$")
_NULL = re.compile(r"^(?:~|null|Null|NULL|)$")
_NUMERIC_START = set("-+0123456789.")
_TAG = "tag:yaml.org,2002:"


class YamlError(ValueError):
    """A refusal with the 0-based line it concerns."""

    def __init__(self, line: int, message: str):
        super().__init__(message)
        self.line = line


class Lines:
    """Where each key or item of a mapping or list starts (0-based line, column), in the shape of
    ruamel's `.lc` (`lc.key(k)`, `lc.item(i)`), for error messages that name a line."""

    __slots__ = ("_at",)

    def __init__(self) -> None:
        self._at: dict[Any, tuple[int, int]] = {}

    def key(self, key: Any) -> tuple[int, int]:
        return self._at[key]

    item = key


class Map(dict):
    __slots__ = ("lc",)
    lc: Lines


class Seq(list):
    __slots__ = ("lc",)
    lc: Lines


def _int(text: str) -> int:
    value = text.replace("_", "")
    sign = -1 if value[:1] == "-" else 1
    value = value.lstrip("+-")
    for prefix, base in (("0b", 2), ("0x", 16), ("0o", 8)):
        if value.startswith(prefix):
            return sign * int(value[2:], base)
    return sign * int(value)


def _float(text: str) -> float:
    value = text.replace("_", "").lower()
    if value.endswith(("inf", "nan")):
        return -math.inf if value.startswith("-") else math.nan if value.endswith("nan") else math.inf
    return float(value)


def scalar(value: str, tag: str | None, plain: bool) -> Any:
    """A scalar's value: an explicit standard tag, else the 1.2 core schema for a plain scalar."""
    if tag and tag not in ("!", "?"):
        kind = tag[len(_TAG):] if tag.startswith(_TAG) else "str"
    elif not plain:
        return value
    elif not value:
        return None
    else:
        first = value[0]
        if first in _NUMERIC_START:
            kind = "int" if _INT.match(value) else "float" if _FLOAT.match(value) else "str"
        elif first in "tTfF" and _BOOL.match(value):
            kind = "bool"
        elif first in "~nN" and _NULL.match(value):
            kind = "null"
        else:
            return value
    if kind == "int":
        return _int(value)
    if kind == "float":
        return _float(value)
    if kind == "bool":
        return value.lower() == "true"
    if kind == "null":
        return None
    return value  # str, and any other tag (a timestamp stays its text; the spec's model checks it)


class _Frame:
    __slots__ = ("node", "line", "column", "anchor", "key", "has_key", "key_line", "size", "height", "merges")

    def __init__(self, node: Any, line: int, column: int, anchor: str | None):
        self.node, self.line, self.column, self.anchor = node, line, column, anchor
        self.key, self.has_key, self.key_line = None, False, (line, column)
        self.size, self.height = 1, 0
        self.merges: list[Any] = []


_SPECIAL = set("-+0123456789.tTfF~nN<")  # plain scalars starting otherwise are strings (1.2 core schema)


class _Builder:
    """The tree of one document, built event by event with its bounds checked as it grows."""

    def __init__(self, max_depth: int, max_values: int):
        self.max_depth, self.max_values = max_depth, max_values
        self.anchors: dict[str, tuple[Any, int, int]] = {}  # anchor -> (value, expanded size, height)
        self.stack: list[_Frame] = []
        self.root: Any = None
        self.documents = 0

    def add(self, value: Any, size: int, height: int, line: int, column: int, collection: bool) -> None:
        stack = self.stack
        if not stack:
            if size > self.max_values:
                raise YamlError(line, f"more than {self.max_values:,} values once YAML aliases are expanded")
            self.root = value
            return
        top = stack[-1]
        if len(stack) + height > self.max_depth:
            raise YamlError(line, f"nested more than {self.max_depth} levels deep")
        top.size += size
        if height >= top.height:
            top.height = height + 1
        if top.size > self.max_values:
            raise YamlError(line, f"more than {self.max_values:,} values once YAML aliases are expanded")
        node = top.node
        if type(node) is Seq:
            node.lc._at[len(node)] = (line, column)
            node.append(value)
        elif not top.has_key:
            if collection:
                raise YamlError(line, "a mapping key must be a name or a number, not a nested collection")
            top.key, top.has_key, top.key_line = value, True, (line, column)
        else:
            key, top.has_key = top.key, False
            if key == "<<" and isinstance(value, (dict, list)):
                top.merges.append(value)
                return
            try:
                duplicate = key in node
            except TypeError:
                raise YamlError(top.key_line[0], "a mapping key must be a name or a number") from None
            if duplicate:
                raise YamlError(top.key_line[0], f"duplicate key {str(key)[:60]!r}")
            node.lc._at[key] = top.key_line
            node[key] = value

    def event(self, event: Any) -> None:
        mark = event.start_mark
        kind = type(event)
        if kind is yaml.ScalarEvent:
            value = event.value
            if event.tag is not None or not event.implicit[0] or not value or value[0] in _SPECIAL:
                value = scalar(value, event.tag, event.implicit[0])
            if event.anchor:
                self.anchors[event.anchor] = (value, 1, 0)
            self.add(value, 1, 0, mark.line, mark.column, False)
        elif kind is yaml.MappingStartEvent or kind is yaml.SequenceStartEvent:
            stack = self.stack
            if len(stack) >= self.max_depth:
                raise YamlError(mark.line, f"nested more than {self.max_depth} levels deep")
            if stack and type(stack[-1].node) is Map and not stack[-1].has_key:
                raise YamlError(mark.line, "a mapping key must be a name or a number, not a nested collection")
            node: Map | Seq = Map() if kind is yaml.MappingStartEvent else Seq()
            node.lc = Lines()
            stack.append(_Frame(node, mark.line, mark.column, event.anchor))
        elif kind is yaml.MappingEndEvent or kind is yaml.SequenceEndEvent:
            frame = self.stack.pop()
            for merged in frame.merges:
                for part in merged if isinstance(merged, list) else [merged]:
                    if isinstance(part, dict):
                        for key, value in part.items():
                            frame.node.setdefault(key, value)
            if frame.anchor:
                self.anchors[frame.anchor] = (frame.node, frame.size, frame.height)
            self.add(frame.node, frame.size, frame.height, frame.line, frame.column, True)
        elif kind is yaml.AliasEvent:
            if any(frame.anchor == event.anchor for frame in self.stack):
                raise YamlError(mark.line, f"nested more than {self.max_depth} levels deep (an alias inside itself)")
            if event.anchor not in self.anchors:
                raise YamlError(mark.line, f"unknown alias {event.anchor[:60]!r}")
            value, size, height = self.anchors[event.anchor]
            self.add(value, size, height, mark.line, mark.column, isinstance(value, (dict, list)))
        elif kind is yaml.DocumentStartEvent:
            self.documents += 1
            if self.documents > 1:
                raise YamlError(mark.line, "expected one YAML document, found more")


def load(text: str, *, max_depth: int, max_values: int) -> Any:
    """The document's data (Map/Seq/scalars), or YamlError / yaml.YAMLError."""
    builder = _Builder(max_depth, max_values)
    parser = _PARSER(text)
    try:
        while True:  # get_event, not yaml.parse: one C call an event, no generator in between
            event = parser.get_event()
            if event is None or type(event) is yaml.StreamEndEvent:
                break
            builder.event(event)
    finally:
        parser.dispose()
    return builder.root
