"""What a user reads: the plan, its candidates table, errors, help and the bundle README (issue 16).

Every test runs the CLI as a user does (a fresh `python -m gpuprov`) and asserts on its output.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True,
                          timeout=180, **kw)


def ok(*args: str) -> str:
    r = run(*args)
    assert r.returncode == 0, r.stderr
    return r.stdout


# --------------------------------------------------------------------------- 1. no internal wording
SEED = re.compile(r"\bseed'?s?\b", re.I)


@pytest.mark.parametrize("args", [
    ("explain", "--help"),
    ("plan", "--model", "70b", "--tokens", "20B"),
    ("explain", "--model", "70b", "--tokens", "20B"),
    ("instances",),
])
def test_no_command_talks_about_a_seed(args):
    out = ok(*args)
    assert not SEED.search(out), SEED.search(out)


def test_rule_of_thumb_is_named_and_cited():
    out = ok("plan", "--model", "70b", "--tokens", "20B")
    assert "18 B/param rule of thumb (mixed-precision Adam)" in out
    from gpuprov.host import rules

    src = rules()["memory"]["source"]
    assert "Rajbhandari" in src and "3.1" in src and "Korthikanti" in src and "theoretical_memory_usage" in src
    assert rules()["memory"]["rule_of_thumb_bytes_per_param"] == 18


def test_catalog_sources_and_bundle_readme_say_no_seed(tmp_path):
    for f in (REPO / "gpuprov" / "catalog" / "data").glob("*.yaml"):
        assert not SEED.search(f.read_text()), f
    ok("generate", "--model", "llama-3.1-8b", "--task", "lora", "--tokens", "200M", "-o", str(tmp_path / "b"))
    readme = (tmp_path / "b" / "README.md").read_text()
    assert not SEED.search(readme)
    assert "18 bytes/parameter rule of thumb for mixed-precision Adam" in readme
