"""A bundle's rendered files kept in the user's cache folder (usercache.py), so generating the same plan again
(a later run, `check` on an unchanged bundle) reads them instead of loading Jinja and every renderer.

The renderers read the Plan and nothing else but gpuprov's own files, so an entry is keyed by a hash of
plan.json's text, every gpuprov source and catalog file (search_memo.code_tag), every file under the templates
and Ansible folders, and the source of Jinja and MarkupSafe, which turn templates into text. Anything else
changed is another key. Like the search memo it serves only a whole process (cli.main switches both on).
"""

from __future__ import annotations

import hashlib
import marshal
import os
from functools import lru_cache
from typing import Callable

from gpuprov.planning import search_memo

KEEP = 16  # bundles kept (about half a MiB each)


@lru_cache(maxsize=None)
def data_tag() -> bytes:
    """A hash of the templates, the Ansible roles and the template engine's source."""
    import importlib.util

    from gpuprov.resources import ansible_dir, templates_dir

    digest = hashlib.sha256()
    for root in (str(templates_dir()), str(ansible_dir())):
        digest.update(f"\0{root}\0".encode())
        search_memo.hash_tree(digest, root, lambda folder, name: True)
    for package in ("jinja2", "markupsafe"):
        spec = importlib.util.find_spec(package)
        where = spec.origin if spec is not None else None
        digest.update(f"\0{package}\0{where}\0".encode())
        if where:
            search_memo.hash_tree(digest, os.path.dirname(where), lambda folder, name: name.endswith(".py"))
    return digest.digest()


def rendered(plan_text: str, render: Callable[[], dict[str, str]]) -> dict[str, str]:
    """`render()`'s files for the plan whose plan.json is `plan_text`, from the cache where present."""
    from gpuprov.usercache import cache_dir, write_atomic

    folder = cache_dir("bundle") if search_memo.ENABLED else None
    if folder is None:
        return render()
    digest = hashlib.sha256(search_memo.code_tag() + data_tag() + plan_text.encode("utf-8")).hexdigest()
    path = folder / f"{digest[:40]}.marshal"
    try:
        found = marshal.loads(path.read_bytes())
        if isinstance(found, tuple) and len(found) == 2 and found[0] == digest and isinstance(found[1], dict):
            return found[1]
    except Exception:  # noqa: BLE001 - absent, truncated or foreign: render afresh
        pass
    files = render()
    search_memo.trim(folder, "*.marshal", KEEP)
    write_atomic(path, marshal.dumps((digest, files)))
    return files
