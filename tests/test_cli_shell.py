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
