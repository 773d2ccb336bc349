"""Issue 12 findings 5, 6 and 12: input limits (YAML aliases, nesting, sizes, huge numbers, long
names) and every failure the fuzzers found end in one line and exit 2, never a traceback or exit 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from injection_support import assert_one_line_error, cli
from plan_fixtures import TINY_LLAMA_CONFIG

BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))


def _spec(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gpuprov.yaml"
    path.write_text(text)
    return path


def test_alias_bomb_is_refused_fast(tmp_path: Path) -> None:
    assert len(BOMB) < 400
    start = time.perf_counter()
    line = assert_one_line_error(*cli("plan", "-f", str(_spec(tmp_path, BOMB)))[::2])
    assert time.perf_counter() - start < 10  # minutes and gigabytes before the limit
    assert "aliases" in line


@pytest.mark.parametrize("text,word", [
    ("model: " + "[" * 200 + "]" * 200 + "\n", "nested"),
    ("model: &a [*a]\n", "nested"),  # an alias inside itself: infinitely deep
    ("tokens: 1" + "0" * 320 + "\n", "tokens"),
    ("tokens: 1" + "0" * 5000 + "\n", "invalid YAML"),
    ("seq_len: " + "9" * 30 + "\n", "seq_len"),
    ("max_nodes: 1e309\n", "max_nodes"),
    ("global_batch_tokens: 1e300\n", "global_batch_tokens"),
    ("model: " + "x" * 300 + ".json\n", "255 bytes"),
    ("model: " + "a/" * 2100 + "config.json\n", "4096 bytes"),
    ("deadline_hours: 1e300\n", "deadline_hours"),
])
def test_spec_limits(tmp_path: Path, text: str, word: str) -> None:
    line = assert_one_line_error(*cli("plan", "-f", str(_spec(tmp_path, text)))[::2])
    assert word in line


def test_large_spec_file_is_refused(tmp_path: Path) -> None:
    line = assert_one_line_error(*cli("plan", "-f", str(_spec(tmp_path, "# x\n" * 300_000)))[::2])
    assert "KiB" in line


def _write(path: Path, data: bytes | str) -> Path:
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass"))
    return path


@pytest.mark.parametrize("setup,word", [
    (lambda d: d / "missing.ini", "no such file"),
    (lambda d: _write(d / "bin.cfg", b"\xff\xfe\x00gpu0 10.0.0.1\n"), "UTF-8"),
    (lambda d: _write(d / "nul.ini", b"gpu0 10.0.0.1\x00\n"), "NUL"),
    (lambda d: (os.symlink("loop.ini", d / "loop.ini"), d / "loop.ini")[1], "cannot read"),
    (lambda d: d / ("h" * 300 + ".ini"), "cannot read"),
])
def test_bad_hosts_files(tmp_path: Path, setup, word: str) -> None:
    line = assert_one_line_error(*cli("plan", "--hosts", str(setup(tmp_path)))[::2])
    assert word in line


def _config_text(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "config.json"
    _write(path, text)
    return path


@pytest.mark.parametrize("text,word", [
    ('{"a": ' + "[" * 1000 + "]" * 1000 + "}", "nested"),
    ('{"a": ' + "[" * 100 + "]" * 100 + "}", "nested"),
    ('{"vocab_size": 1' + "0" * 5000 + "}", "digits"),
    ('{"model_type": "llama", "x": "\\ud800"}', "surrogate"),
    ('{"hidden_size": NaN}', "NaN"),
    ("[1, 2]", "JSON object"),
    (b"\xff{}", "UTF-8"),
])
def test_bad_config_json(tmp_path: Path, text: str | bytes, word: str) -> None:
    line = assert_one_line_error(*cli("plan", "--model", str(_config_text(tmp_path, text)))[::2])
    assert word in line


def test_long_model_path_is_one_line(tmp_path: Path) -> None:
    line = assert_one_line_error(*cli("plan", "--model", "m" * 300 + "/config.json")[::2])
    assert "255 bytes" in line


def _run(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True, timeout=120, **kw)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_stdout_to_a_full_device() -> None:
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "gpuprov", "models"], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_stdout_closed() -> None:
    proc = subprocess.run(f"{sys.executable} -m gpuprov models >&-", shell=True, stderr=subprocess.PIPE,
                          text=True, timeout=120)
    assert proc.returncode in (2, 141), proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 1, proc.stderr


def test_unexpected_error_is_one_line_exit_2(monkeypatch) -> None:
    import gpuprov.commands.catalogs as catalogs

    def boom(*_a, **_k):
        raise RuntimeError("surprise\nsecond line")

    monkeypatch.setattr(catalogs, "list_models", boom, raising=False)
    monkeypatch.setattr("gpuprov.catalog.models.list_models", boom)
    line = assert_one_line_error(*cli("models")[::2])
    assert "surprise second line" in line


# ---- 12: cross-field and range checks ---------------------------------------------------------------

def test_estimate_gpus_fewer_than_per_node() -> None:
    line = assert_one_line_error(*cli("estimate", "--model", "7b", "--gpu", "h100-80gb", "--gpus", "2",
                                      "--gpus-per-node", "8")[::2])
    assert "--gpus" in line and "--gpus-per-node" in line


def test_check_diff_lines_must_not_be_negative(tmp_path: Path) -> None:
    line = assert_one_line_error(*cli("check", str(tmp_path), "--diff-lines", "-5")[::2])
    assert "--diff-lines" in line


def test_absurd_batch_is_one_line(tmp_path: Path) -> None:
    line = assert_one_line_error(*cli("plan", "--global-batch-tokens", "1" + "0" * 300)[::2])
    assert "--global-batch-tokens" in line


def test_config_json_within_limits_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_LLAMA_CONFIG, "rope_scaling": {"type": "llama3", "factor": 8.0}}))
    code, out, err = cli("estimate", "--model", str(path), "--gpu", "h100-80gb", "--gpus", "1")
    assert code == 0, err


def test_deeply_nested_lock_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "gpuprov.lock").write_text("[" * 100_000 + "]" * 100_000)
    line = assert_one_line_error(*cli("check", str(tmp_path))[::2])
    assert "unreadable lock" in line


@pytest.mark.parametrize("args,word", [
    # `--spec "$SPEC"` with SPEC unset planned (and generated) the defaults as if no file were meant
    (["--spec", ""], "--spec is empty"),
    (["--hosts", " "], "--hosts is empty"),
    # an empty filter widened the search to every GPU / purchase option instead of restricting it
    (["--gpu", ""], "--gpu '' names nothing"),
    (["--gpu", " , "], "names nothing"),
    (["--purchase", ""], "--purchase '' names nothing"),
    (["--task", "lora", "--lora-targets", ","], "--lora-targets ',' names nothing"),
    (["--gpus", "99999999999999999999"], "--gpus"),
])
@pytest.mark.parametrize("command", ["plan", "generate"])
def test_empty_or_absurd_flags_are_refused(tmp_path: Path, command: str, args: list[str], word: str) -> None:
    out = ["-o", str(tmp_path / "out")] if command == "generate" else []
    line = assert_one_line_error(*cli(command, "--model", "7b", *args, *out)[::2])
    assert word in line
    assert not (tmp_path / "out").exists()
