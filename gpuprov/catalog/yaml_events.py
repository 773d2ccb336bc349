"""A catalog file built straight from libyaml's parser events: the tree the catalog loader builds, in one pass.

The loader (catalog/__init__.py: PyYAML's CSafeLoader taught the YAML 1.2 core schema and refusing duplicate keys)
first composes a node per value, then constructs the tree from the nodes through generators; building dicts and
lists from the events as they come skips both. The scalars resolve through the loader's own resolver table and
its own constructors, so a value is what the loader makes of it. What this pass does not build, it hands to the
loader whole: any tag, a timestamp, a second document, a key seen twice in one mapping (the loader says
which are duplicates), a collection as a key, an anchor defined twice or used inside itself, and any merge key
(`<<`) but one that merges a single mapping which itself merged nothing. tests/test_fabric_catalog.py holds
both to the same tree on every catalog and on each of those cases.
"""

from __future__ import annotations

from typing import Any

_STR = "tag:yaml.org,2002:str"
_NULL = "tag:yaml.org,2002:null"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_BUILT = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:bool")


class Unbuilt(Exception):
    """A document this pass leaves to the loader."""


class _Merge:
    """A plain `<<`: a merge key, never a value."""


_MERGE = _Merge()


class _Frame:
    __slots__ = ("node", "is_map", "key", "has_key", "anchor", "merges")

    def __init__(self, is_map: bool, anchor: str | None) -> None:
        self.node: Any = {} if is_map else []
        self.is_map, self.key, self.has_key, self.anchor = is_map, None, False, anchor
        self.merges: list[Any] = []


class _Builder:
    def __init__(self, loader: type) -> None:
        resolvers = loader.yaml_implicit_resolvers  # type: ignore[attr-defined]
        if None in resolvers:  # a resolver for any first character: not this pass's table
            raise Unbuilt()
        self.resolvers: dict[str, list] = resolvers
        self.constructors = loader.yaml_constructors  # type: ignore[attr-defined]
        self.loader = loader
        self.instance: Any = None  # a loader, for the constructors of numbers and booleans
        self.stack: list[_Frame] = []
        self.anchors: dict[str, Any] = {}
        self.open_anchors: set[str] = set()
        self.merged: set[int] = set()  # ids of mappings built with a merge (held by self.anchors while they count)
        self.root: Any = None

    def scalar(self, event: Any) -> Any:
        if event.tag is not None:
            raise Unbuilt()
        value = event.value
        if not event.implicit[0]:  # quoted: a string
            return value
        tag = _STR
        for candidate, regexp in self.resolvers.get(value[:1], ()):  # as the loader's resolve() looks them up
            if regexp.match(value):
                tag = candidate
                break
        if tag == _STR:
            return value
        if tag == _NULL:
            return None
        if tag == _MERGE_TAG:
            return _MERGE
        if tag not in _BUILT:
            raise Unbuilt()
        import yaml

        if self.instance is None:
            self.instance = self.loader("")
        return self.constructors[tag](self.instance, yaml.ScalarNode(tag, value))

    def add(self, value: Any) -> None:
        if not self.stack:
            if value is _MERGE:
                raise Unbuilt()
            self.root = value
            return
        top = self.stack[-1]
        if not top.is_map:
            if value is _MERGE:
                raise Unbuilt()
            top.node.append(value)
        elif not top.has_key:
            if isinstance(value, (dict, list)):
                raise Unbuilt()
            top.key, top.has_key = value, True
        else:
            key, top.has_key = top.key, False
            if value is _MERGE:
                raise Unbuilt()
            if key is _MERGE:
                top.merges.append(value)
            elif key in top.node:
                raise Unbuilt()
            else:
                top.node[key] = value

    def end(self) -> None:
        frame = self.stack.pop()
        node = frame.node
        if frame.merges:
            source = frame.merges[0]
            if len(frame.merges) > 1 or not isinstance(source, dict) or id(source) in self.merged:
                raise Unbuilt()
            node = {**source}
            node.update(frame.node)  # the mapping's own keys after the merged ones, overriding them in place
            self.merged.add(id(node))
        if frame.anchor is not None:
            self.open_anchors.discard(frame.anchor)
            self.anchors[frame.anchor] = node
        self.add(node)

    def anchor(self, name: str | None) -> None:
        if name is not None and (name in self.anchors or name in self.open_anchors):
            raise Unbuilt()


def load(text: str, loader: type) -> Any:
    """The document's tree as `yaml.load(text, Loader=loader)` builds it; Unbuilt where this pass leaves it to
    the loader (a document the loader refuses included: it says why)."""
    import yaml

    builder = _Builder(loader)
    parser = loader(text)
    documents = 0
    first = builder.resolvers.keys()  # the first characters the resolvers look at ('' for an empty scalar)
    try:
        while True:
            event = parser.get_event()
            kind = type(event)
            if kind is yaml.ScalarEvent:
                value = event.value
                if event.tag is None and event.anchor is None and (not event.implicit[0] or value[:1] not in first):
                    builder.add(value)  # a quoted scalar, or a plain one no resolver looks at: a string
                    continue
                builder.anchor(event.anchor)
                value = builder.scalar(event)
                if event.anchor is not None:
                    if value is _MERGE:
                        raise Unbuilt()
                    builder.anchors[event.anchor] = value
                builder.add(value)
            elif kind is yaml.MappingStartEvent or kind is yaml.SequenceStartEvent:
                if event.tag is not None:
                    raise Unbuilt()
                builder.anchor(event.anchor)
                if event.anchor is not None:
                    builder.open_anchors.add(event.anchor)
                builder.stack.append(_Frame(kind is yaml.MappingStartEvent, event.anchor))
            elif kind is yaml.MappingEndEvent or kind is yaml.SequenceEndEvent:
                builder.end()
            elif kind is yaml.AliasEvent:
                if event.anchor not in builder.anchors:
                    raise Unbuilt()
                builder.add(builder.anchors[event.anchor])
            elif kind is yaml.DocumentStartEvent:
                documents += 1
                if documents > 1:
                    raise Unbuilt()
            elif event is None or kind is yaml.StreamEndEvent:
                return builder.root
    except yaml.YAMLError:
        raise Unbuilt() from None
    finally:
        parser.dispose()
