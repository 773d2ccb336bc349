"""What only a whole gpuprov process does at start (cli._as_a_process): no pydantic plugin scan, and the cyclic
collector paused while the command's modules load, then running again for what the command allocates."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import atexit, gc, sys
sys.argv = ["gpuprov", *sys.argv[1:]]
atexit.register(lambda: print(gc.isenabled(), gc.get_freeze_count(), "importlib.metadata" in sys.modules,
                              file=sys.stderr))
from gpuprov.cli import main
main()
"""


def _process(*args: str) -> tuple[bool, int, bool]:
    r = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    enabled, frozen, metadata = r.stderr.split()[-3:]
    return enabled == "True", int(frozen), metadata == "True"


def test_a_command_runs_with_the_collector_on_its_modules_frozen_and_no_plugin_scan():
    enabled, frozen, metadata = _process("plan", "--model", "8b", "--task", "lora")
    assert enabled and frozen > 10_000  # the command's modules, loaded with the collector paused
    assert not metadata  # pydantic built every model without reading the installed distributions


def test_a_library_caller_keeps_its_collector_and_pydantic_as_they_were():
    code = ("import gc, sys; from click.testing import CliRunner; from gpuprov.cli import cli; "
            "r = CliRunner().invoke(cli, ['plan', '--model', '8b', '--task', 'lora']); "
            "print(r.exit_code, gc.isenabled(), gc.get_freeze_count(), "
            "getattr(sys.modules.get('pydantic.plugin._loader'), '__file__', None) is not None)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    # pydantic's own plugin loader, read from its file, served the models
    assert r.stdout.split() == ["0", "True", "0", "True"], r.stdout + r.stderr
