"""The CLI shell: help lists every command, unknown commands and bad flags exit 2 with no traceback."""

from __future__ import annotations

import subprocess
import sys

from gpuprov.cli import COMMANDS


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True)


def test_help_lists_every_command() -> None:
    result = run("--help")
    assert result.returncode == 0
    for name in COMMANDS:
        assert name in result.stdout


def test_version() -> None:
    result = run("--version")
    assert result.returncode == 0 and "gpuprov" in result.stdout


def test_unknown_command_is_usage_error() -> None:
    result = run("frobnicate")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "No such command" in result.stderr


def test_every_command_has_help() -> None:
    for name in COMMANDS:
        result = run(name, "--help")
        assert result.returncode == 0, (name, result.stderr)
        assert "Traceback" not in result.stderr


# ---------------------------------------------------------------- exit codes, in process

import os  # noqa: E402

import click  # noqa: E402
import pytest  # noqa: E402

from gpuprov import cli  # noqa: E402
from gpuprov.errors import DriftError, GpuprovError  # noqa: E402


@click.command()
@click.argument("code", type=int)
@click.pass_context
def _exits(ctx: click.Context, code: int) -> None:
    click.echo(f"exiting {code}")
    ctx.exit(code)


@click.command()
@click.argument("kind")
def _raises(kind: str):
    if kind == "drift":
        raise DriftError("2 generated file(s) differ")
    if kind == "error":
        raise GpuprovError("unknown model 'x'")
    return {"not": "an exit code"}  # a command's return value is not an exit status


@pytest.fixture
def test_commands(monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "exits", (__name__, "_exits", "ctx.exit(n)"))
    monkeypatch.setitem(cli.COMMANDS, "raises", (__name__, "_raises", "raise"))


def exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    return info.value.code


@pytest.mark.parametrize("code", [0, 1, 2, 3])
def test_ctx_exit_code_reaches_the_shell(test_commands, code, capsys) -> None:
    assert exit_code(["exits", str(code)]) == code
    assert capsys.readouterr().out == f"exiting {code}\n"


@pytest.mark.parametrize("kind,code", [("drift", 1), ("error", 2), ("fine", 0)])
def test_errors_are_one_line_with_their_exit_code(test_commands, kind, code, capsys) -> None:
    assert exit_code(["raises", kind]) == code
    err = capsys.readouterr().err
    assert ("" if code == 0 else "gpuprov: error: ") in err and err.count("\n") == (code != 0)


def test_usage_errors_exit_2(test_commands, capsys) -> None:
    assert exit_code(["exits", "not-a-number"]) == 2
    assert exit_code(["exits"]) == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("args", [("check", "/nowhere"), ("validate", "/nowhere"), ("up", "/nowhere", "--dry-run"),
                                  ("explain", "--model", "no-such-model")])
def test_documented_exit_2_for_input_errors(args) -> None:
    result = run(*args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("gpuprov: error: ") and result.stderr.count("\n") == 1


# ---------------------------------------------------------------- a reader that stops early


def run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess:
    """Run gpuprov with its stdout a pipe whose reader is already gone (`gpuprov ... | head -0`)."""
    read, write = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "gpuprov", *args], stdout=write, stderr=subprocess.PIPE)
    os.close(write)
    os.close(read)
    _, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, None, err.decode())


@pytest.mark.parametrize("args", [("models",), ("--help",), ("generate", "--model", "70b", "-o", "-"),
                                  ("estimate", "--model", "8b", "--json")])
def test_closed_pipe_is_quiet(args) -> None:
    result = run_into_closed_pipe(*args)
    assert result.stderr == ""  # no traceback, no "Exception ignored ... BrokenPipeError"
    assert result.returncode in (0, 141)  # not 1: that is drift


def test_head_reads_the_first_line() -> None:
    result = subprocess.run(f"'{sys.executable}' -m gpuprov models | head -1", shell=True, capture_output=True,
                            text=True)
    assert result.returncode == 0 and result.stdout.startswith("name") and result.stderr == ""
