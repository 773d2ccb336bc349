"""Bounded fuzzing that keeps issue 25's classes closed (the whole module runs in well under 2 minutes).

1. Addresses, CIDRs, host and user names built from Jinja, zone-id and shell fragments: exit 0 or a
   one-line exit 2, and no Jinja marker anywhere in a written bundle (roles aside) beyond a benign one.
2. Special files (FIFO, folder, /dev/zero, a link out of the bundle) at each bundle path the
   commands read, for check, validate, up, down and generate onto the bundle: exit 1 or 2 within
   10 s, one line, never the last-resort "unexpected".
3. Nested YAML (flow or block, brackets or braces, collection keys) as a spec or hosts file: exit 2
   within 1 s.
4. stdout closed: one line, exit 2.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st

from injection_support import cli

MARKER = re.compile(r"\{[{%#]")
UNSAFE = re.compile(r'!unsafe "(?:[^"\\]|\\.)*"')
FAST = settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)
REPO = Path(__file__).resolve().parents[1]

FRAGMENTS = ["fe80::1", "%", "%eth0", "{{", "}}", "{%", "%}", "{#", "#}", "lookup('pipe','touch PWNED')",
             "$(touch PWNED)", "\n", " ", "::", "/64", "/24", "203.0.113.0", "10.0.0.1", "gpu0", "\u202e",
             "'", '"', ",", ": ", "- ", "ubuntu", ".", "-", "_"]
hostile = st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=6).map("".join)


def _no_unexpected(code: int, err: str, allowed: tuple[int, ...] = (0, 2)) -> None:
    assert code in allowed, (code, err)
    assert "Traceback" not in err and "unexpected" not in err, err
    if code == 2:
        lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("note:", "Usage:", "Try '"))]
        assert len(lines) == 1, err


def _markers(root: Path) -> dict[str, int]:
    """Jinja markers per file outside roles/ and outside !unsafe scalars."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and "/roles/" not in f"/{rel}":
            found[rel] = len(MARKER.findall(UNSAFE.sub('""', path.read_text(encoding="utf-8"))))
    return found


@lru_cache(maxsize=None)
def _benign_markers(kind: str) -> tuple:
    work = Path(tempfile.mkdtemp(prefix="gpuprov-sec-benign-"))
    try:
        code, _, err = cli(*_generate_args(work, kind, "gpu0" if kind != "ssh_cidr" else "203.0.113.0/24",
                                           field="name" if kind != "ssh_cidr" else "ssh_cidr"))
        assert code == 0, err
        return tuple(sorted(_markers(work / "out").items()))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _generate_args(work: Path, kind: str, value: str, field: str) -> list[str]:
    spec = {"model": "7b", "gpus": ["h100-80gb"], "max_nodes": 2}
    args = []
    if field == "ssh_cidr":
        spec.update(cloud="azure", ssh_cidr=value)  # AWS refuses --ssh-cidr (no public node addresses)
    else:
        host = {"name": "gpu0", "address": "10.0.0.1", "user": "ubuntu", field: value}
        (work / "hosts.json").write_text(json.dumps([host]))
        args = ["--hosts", str(work / "hosts.json")]
    (work / "spec.yaml").write_text(json.dumps(spec))  # JSON is YAML: the value arrives exactly
    return ["generate", "-f", str(work / "spec.yaml"), *args, "-o", str(work / "out")]


@pytest.fixture
def cached_roles(monkeypatch):
    from gpuprov.render.ansible import copy_roles

    roles = dict(copy_roles())
    monkeypatch.setattr("gpuprov.render.ansible.copy_roles", lambda: roles)


@seed(25)
@settings(FAST, max_examples=40)
@example(field="address", value="eth0", zone=True)  # fe80::1%eth0: written, no marker
@example(field="address", value="{{lookup('pipe','touch PWNED')}}", zone=True)
@example(field="ssh_cidr", value="{{x}}", zone=True)
@example(field="name", value="gpu0", zone=False)
@example(field="user", value="{% raw %}", zone=False)
@given(field=st.sampled_from(["address", "name", "user", "ssh_cidr"]), value=hostile,
       zone=st.booleans())
def test_hostile_addresses_and_names_never_reach_a_bundle_as_jinja(cached_roles, field: str, value: str,
                                                                   zone: bool) -> None:
    if zone and field in ("address", "ssh_cidr"):
        value = ("fe80::1%" if field == "address" else "fe80::%") + value + ("/64" if field == "ssh_cidr" else "")
    kind = "ssh_cidr" if field == "ssh_cidr" else "hosts"
    work = Path(tempfile.mkdtemp(prefix="gpuprov-sec-fuzz-"))
    try:
        code, _, err = cli(*_generate_args(work, kind, value, field))
        _no_unexpected(code, err)
        if code == 0:
            assert tuple(sorted(_markers(work / "out").items())) == _benign_markers(kind), value
        else:
            assert not (work / "out").exists()
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- 2. special files x bundle files x commands ----------------------------------------------------

@pytest.fixture(scope="module")
def real_bundle(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sec") / "infra"
    code, _, err = cli("generate", "--model", "7b", "--gpu", "h100-80gb", "--cloud", "aws", "-o", str(root))
    assert code == 0, err
    (root / "terraform" / "terraform.tfvars").write_text('region = "us-east-1"\n')
    (root / ".gpuprov-up.json").write_text("{}\n")
    (root / "ansible" / "inventory.yml").write_text("all: {}\n")
    return root


PATHS = ["gpuprov.lock", "plan.json", ".gpuprov-up.json", "terraform/main.tf", "terraform/terraform.tfvars",
         "ansible/site.yml", "ansible/inventory.yml", "launch/train.sh"]
KINDS = ["fifo", "dir", "zero", "outside"]


def _plant(path: Path, kind: str, outside: Path) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    elif kind == "zero":
        os.symlink("/dev/zero", path)
    else:
        os.symlink(outside, path)


class _Hang(Exception):
    pass


def _within(seconds: int, function, *args):
    def alarm(signum, frame):
        raise _Hang(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        return function(*args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


QUICK = [("validate", "--offline"), ("up", "--dry-run"), ("down", "--dry-run")]


@pytest.mark.parametrize("kind", KINDS)
def test_special_files_are_refused_within_10_s(real_bundle: Path, tmp_path: Path, kind: str) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("not the bundle's\n")
    for rel in PATHS:
        root = tmp_path / f"b-{rel.replace('/', '_')}"
        shutil.copytree(real_bundle, root, symlinks=True)
        _plant(root / rel, kind, outside)
        for command, flag in QUICK:
            code, _, err = _within(10, cli, command, str(root), flag)
            _no_unexpected(code, err, (2,))
        assert outside.read_text() == "not the bundle's\n"


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_check_and_generate_onto_a_bundle_with_special_files(real_bundle: Path, tmp_path: Path, kind: str) -> None:
    """check answers drift (1) or refuses (2); generate onto the bundle refuses; neither hangs."""
    for rel in PATHS:
        root = tmp_path / f"b-{rel.replace('/', '_')}"
        shutil.copytree(real_bundle, root, symlinks=True)
        _plant(root / rel, kind, tmp_path)
        code, _, err = _within(10, cli, "check", str(root))
        _no_unexpected(code, err, (1, 2))
        lock = str(real_bundle / "gpuprov.lock")
        code, _, err = _within(10, cli, "generate", "-f", lock, "-o", str(root))
        _no_unexpected(code, err, (0, 2))  # 0: a symlink at a user path is carried as a symlink, not followed
        if code == 0:
            assert (root / rel).is_symlink()


# ---- 3. nested YAML ------------------------------------------------------------------------------------

def _nested(depth: int, style: str) -> str:
    if style == "flow-list":
        return "a: " + "[" * depth + "]" * depth + "\n"
    if style == "flow-map":
        return "a: " + "{a: " * depth + "1" + "}" * depth + "\n"
    if style == "keys":
        return "{" * depth + "}" * depth + ": 1\n"
    if style == "lines":
        return "a:\n" + "  [\n" * depth
    return "".join("  " * i + "k:\n" for i in range(depth)) + "  " * depth + "v: 1\n"  # block mappings


@seed(2525)
@settings(FAST, max_examples=25)
@given(depth=st.integers(min_value=33, max_value=20_000), style=st.sampled_from(["flow-list", "flow-map", "keys",
                                                                                 "lines", "block"]),
       use=st.sampled_from(["spec", "hosts"]))
def test_nested_yaml_exits_2_within_a_second(tmp_path_factory, depth: int, style: str, use: str) -> None:
    if style == "block":
        depth = min(depth, 400)  # block nesting costs indentation: 400 levels already hold 160 KB
    if style == "keys":
        depth = min(depth, 40) if use == "spec" else depth
    path = tmp_path_factory.mktemp("yaml") / "input.yaml"
    path.write_text(_nested(depth, style))
    args = ["plan", "-f", str(path)] if use == "spec" else ["plan", "--model", "7b", "--hosts", str(path)]
    cli("plan", "--model", "7b")  # imports warm: the second counts
    start = time.monotonic()
    code, _, err = _within(10, cli, *args)
    assert time.monotonic() - start < 1.0, (style, depth, use)
    _no_unexpected(code, err, (2,))


# ---- 4. closed stdout --------------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [["schema"], ["models", "--json"], ["gpus"], ["plan", "--model", "7b", "--json"],
                                  ["estimate", "--model", "7b", "--gpu", "h100-80gb"],
                                  ["generate", "--model", "7b", "-o", "-"]])
def test_closed_stdout(args: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "gpuprov", *args], preexec_fn=lambda: os.close(1),
                          stderr=subprocess.PIPE, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))
    _no_unexpected(proc.returncode, proc.stderr, (2,))
