"""The renderers' Jinja environments, with templates compiled once per template text, not once per run.

Compiling a template (parse, generate Python, compile) costs far more than rendering it, and `generate` loads
every template on each run. Jinja's file bytecode cache keeps the compiled code in the user's cache folder
(usercache.py): an entry is found by the template's path, and reused only where the template's text (Jinja
checks its checksum), Jinja and Python (its magic header) and this environment's options (the file name's
prefix, below: trim_blocks or the comment markers change the code a template compiles to) are unchanged.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any


def environment(directory: Path, **options: Any):
    """A StrictUndefined, non-escaping Environment over `directory` (escaping is the filters' job, per target
    language), with the bytecode cache where the user's cache folder is usable."""
    import jinja2  # lazy: `gpuprov plan` renders nothing

    # optimized=False: Jinja's optimizer folds constant expressions at compile time, which costs a first run more
    # than it saves (a bundle renders each template once; a later run loads compiled code from the cache) and
    # renders the same text either way
    options = {"undefined": jinja2.StrictUndefined, "keep_trailing_newline": True, "trim_blocks": True,
               "lstrip_blocks": True, "autoescape": False, "optimized": False, **options}
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(directory)),
                              bytecode_cache=_bytecode_cache(options), **options)


def _bytecode_cache(options: dict[str, Any]):
    import jinja2
    from jinja2.bccache import FileSystemBytecodeCache

    from gpuprov.usercache import cache_dir

    folder = cache_dir("jinja")
    if folder is None:
        return None
    described = repr(sorted((k, getattr(v, "__name__", v)) for k, v in options.items()))
    tag = hashlib.sha256(f"{jinja2.__version__}|{described}".encode()).hexdigest()[:16]

    class _Cache(FileSystemBytecodeCache):
        """Never fails a render: a cache entry that cannot be read or written is compiled afresh."""

        def load_bytecode(self, bucket) -> None:
            try:
                super().load_bytecode(bucket)
            except Exception:  # noqa: BLE001 - a truncated or foreign entry (pickle, marshal refuse it): compile
                bucket.reset()

        def dump_bytecode(self, bucket) -> None:
            try:
                super().dump_bytecode(bucket)
            except OSError:
                pass

    return _Cache(str(folder), f"{tag}_%s.cache")
