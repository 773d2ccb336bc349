"""The user cache folder keeps derived data only: each entry is exactly what the run would compute, or unused.

Compiled templates, parsed catalogs and allocator replays are kept under $XDG_CACHE_HOME/gpuprov; a changed
source is never served stale, a damaged entry is recomputed, an unusable folder means no cache (never a
failed command), and a bundle is byte for byte the same with the cache cold, warm or off.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuprov import usercache
from gpuprov.catalog import cached_parse, parse_yaml
from gpuprov.render.jinja_env import environment


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(root))
    monkeypatch.delenv("GPUPROV_NO_CACHE", raising=False)
    return root / "gpuprov"


def _render(folder: Path, **options) -> str:
    return environment(folder, **options).get_template("t.j2").render(x="value")


def test_a_changed_template_is_compiled_again_not_served_from_the_cache(cache: Path, tmp_path: Path):
    src = tmp_path / "templates"
    src.mkdir()
    (src / "t.j2").write_text("first {{ x }}\n")
    assert _render(src) == "first value\n"
    assert list((cache / "jinja").glob("*.cache"))  # the compiled code was kept
    assert _render(src) == "first value\n"  # and read back
    (src / "t.j2").write_text("second {{ x }}\n")
    assert _render(src) == "second value\n"
    # other environment options compile the same text to other code: their entries are apart
    (src / "t.j2").write_text("a {{ x }} <#- note -#> {# kept #} end\n")
    assert _render(src) == "a value <#- note -#>  end\n"
    assert _render(src, comment_start_string="<#-", comment_end_string="-#>") == "a value  {# kept #} end\n"


def test_a_damaged_cache_entry_is_compiled_again(cache: Path, tmp_path: Path):
    src = tmp_path / "templates"
    src.mkdir()
    (src / "t.j2").write_text("{{ x }}!\n")
    _render(src)
    for entry in (cache / "jinja").glob("*.cache"):
        entry.write_bytes(entry.read_bytes()[:20])  # truncated mid-way
    assert _render(src) == "value!\n"
    env = environment(src)
    for entry in (cache / "jinja").iterdir():
        entry.unlink()
    (cache / "jinja").rmdir()
    (cache / "jinja").write_text("")  # the folder gone under the running environment: nothing can be written
    (src / "t.j2").write_text("{{ x }}?\n")
    assert env.get_template("t.j2").render(x="value") == "value?\n"


def test_parsed_catalog_text_is_the_parse_and_a_damaged_entry_is_parsed_again(cache: Path):
    text = "a: 1\nb: [x, 2.5, null, true]\nc: {d: '2026-01-02'}\n"
    first = cached_parse(text)
    assert first == parse_yaml(text) and len(list((cache / "catalog").glob("*.marshal"))) == 1
    assert cached_parse(text) == first
    for entry in (cache / "catalog").glob("*.marshal"):
        entry.write_bytes(b"not marshal data")
    assert cached_parse(text) == first
    assert cached_parse("a: 2\n") == {"a": 2}
    dated = "when: 2026-01-02\n"  # a YAML timestamp: a value marshal does not write, so no entry, parsed each run
    assert cached_parse(dated) == parse_yaml(dated) == cached_parse(dated)
    assert len(list((cache / "catalog").glob("*.marshal"))) == 2


def test_int_memo_round_trips_and_keys_by_the_code(cache: Path, tmp_path: Path):
    code = tmp_path / "code.py"
    code.write_text("v = 1\n")
    memo = usercache.IntMemo("t", code)
    assert memo.get("k") is None
    memo.put("k", 7)
    assert memo.get("k") == 7
    assert usercache.IntMemo("t", code).get("k") is None  # written once, at exit
    memo.flush()
    assert usercache.IntMemo("t", code).get("k") == 7  # another process's view
    code.write_text("v = 2\n")  # other code: another table
    assert usercache.IntMemo("t", code).get("k") is None
    for table in (cache / "t").glob("*.json"):
        table.write_text("{broken")
    code.write_text("v = 1\n")
    assert usercache.IntMemo("t", code).get("k") is None


def test_the_cache_is_off_when_asked_or_when_the_folder_is_not_private(cache: Path, monkeypatch):
    assert usercache.cache_dir("x") == cache / "x"
    monkeypatch.setenv("GPUPROV_NO_CACHE", "1")
    assert usercache.cache_dir("x") is None
    monkeypatch.delenv("GPUPROV_NO_CACHE")
    os.chmod(cache / "x", 0o777)  # another user could have written into it
    assert usercache.cache_dir("x") is None
    (cache / "y").parent.mkdir(exist_ok=True)
    (cache / "y").symlink_to(cache / "x")
    assert usercache.cache_dir("y") is None
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/no/such/place")  # cannot be created: no cache, no error
    assert usercache.cache_dir("x") is None


def _generate(out: Path, env: dict) -> dict[str, bytes]:
    r = subprocess.run([sys.executable, "-m", "gpuprov", "generate", "--model", "8b", "--task", "lora",
                        "--tokens", "100M", "-o", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_bundle_is_the_same_with_the_cache_cold_warm_and_off(tmp_path: Path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("GPUPROV_NO_CACHE", None)
    cold = _generate(tmp_path / "cold", env)
    assert list((tmp_path / "cache" / "gpuprov").glob("*/*"))
    warm = _generate(tmp_path / "warm", env)
    off = _generate(tmp_path / "off", {**env, "GPUPROV_NO_CACHE": "1"})
    assert cold == warm == off
