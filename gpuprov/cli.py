"""The `gpuprov` command line: a thin click group whose subcommands load lazily.

Each subcommand lives in `gpuprov/commands/<name>.py` and is imported only when it runs, so
`gpuprov plan` does not pay for what `gpuprov generate` imports (pipelines call it often).
Known errors (GpuprovError) become one line on stderr and exit 2 (drift: 1), never a traceback;
a command's ctx.exit(n) exits n; a closed stdout (`| head`) exits 141 quietly, as `cat` would.
Anything else (a full disk, an unreadable file, a bug) is one line and exit 2 as well: exit 1 is
reserved for drift and failed health checks. GPUPROV_TRACEBACK=1 shows the traceback instead.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import sys

import click

from gpuprov import __version__
from gpuprov.errors import GpuprovError, clip

# name -> (module, attribute, one-line help shown in `gpuprov --help` without importing it)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "estimate": ("gpuprov.commands.estimate", "estimate", "Per-GPU peak memory of one training setup, term by term."),
    "models": ("gpuprov.commands.catalogs", "models", "List the model presets."),
    "gpus": ("gpuprov.commands.catalogs", "gpus", "List the GPU catalog."),
    "instances": ("gpuprov.commands.instances", "instances", "List cloud instance types and on-prem server templates."),
    "plan": ("gpuprov.commands.plan", "plan", "Choose GPU type, instance, nodes and sharding for the cheapest run that fits."),
    "explain": ("gpuprov.commands.plan", "explain", "Show the arithmetic behind a plan, term by term."),
    "generate": ("gpuprov.commands.generate", "generate", "Write the bundle: Terraform, Ansible, launch scripts, README."),
    "init": ("gpuprov.commands.generate", "init", "Write a commented starter spec (gpuprov.yaml)."),
    "schema": ("gpuprov.commands.generate", "schema", "Print the spec's JSON Schema."),
    "check": ("gpuprov.commands.gitops", "check", "Regenerate a bundle from its lock and report drift (exit 1)."),
    "validate": ("gpuprov.commands.gitops", "validate", "Run Terraform, Ansible and shell checks on a bundle."),
    "hosts": ("gpuprov.commands.hosts", "hosts", "On-prem hosts: read what they hold over SSH (hosts probe)."),
    "up": ("gpuprov.commands.up", "up", "Bring a bundle's cluster up: terraform, inventory, ansible, health check."),
    "calibrate": ("gpuprov.commands.calibrate", "calibrate",
                  "A measured run's tokens/s, MFU and memory against its plan; writes a calibration file."),
    "status": ("gpuprov.commands.status", "status", "The training job `up` started: state, step, loss, tokens/s, MFU vs the plan."),
    "down": ("gpuprov.commands.up", "down", "Destroy a bundle's cluster (terraform destroy; on-prem: stop its job and Slurm)."),
    "config": ("gpuprov.commands.habits", "config", "Show the user's defaults file (cloud, region, objective, purchase)."),
    "completion": ("gpuprov.commands.habits", "completion", "Print the shell completion script: bash, zsh or fish."),
}


class _OutputClosed(Exception):
    """The reader of stdout went away (`gpuprov models | head -1`): stop quietly."""


@contextlib.contextmanager
def _closed_output_is_quiet():
    """Turn a broken pipe into _OutputClosed before click sees it.

    click answers EPIPE with exit 1, which gpuprov uses for drift; a closed pipe is not drift.
    """
    try:
        yield
    except BrokenPipeError as exc:
        raise _OutputClosed() from exc


class LazyGroup(click.Group):
    def make_context(self, *args, **kwargs) -> click.Context:
        with _closed_output_is_quiet():  # --help and --version print while the group parses
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: click.Context):
        with _closed_output_is_quiet():
            return super().invoke(ctx)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module_name, attr, _ = COMMANDS[cmd_name]
        command = getattr(importlib.import_module(module_name), attr)
        if _PROCESS["gc_paused"]:  # the command's modules are loaded: they live as long as the process
            _PROCESS["gc_paused"] = False
            gc.freeze()
            gc.enable()
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, help_text) for name, (_, _, help_text) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpuprov")
def cli() -> None:
    """Work backwards from a model to a GPU cluster that can train it.

    \b
    Typical flow:
      gpuprov estimate --model llama-3.1-8b --gpu h100-80gb --gpus 8   # memory per GPU
      gpuprov plan --model 70b --tokens 20B                            # cheapest cluster
      gpuprov generate --model 70b -o infra/                           # Terraform+Ansible+launch
    Exit codes: 0 ok, 1 drift or failed check, 2 input that cannot be served.
    """


SIGPIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a tool stopped by a closed pipe


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush of buffered output cannot fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real file descriptor (tests capture stdout)
        pass


def _exit_code(rc: object) -> int:
    """The command's result as an exit status: ctx.exit(n) gives n; a return value that is no int, 0."""
    return rc if isinstance(rc, int) and not isinstance(rc, bool) else 0


def _json_error(argv: list[str] | None, message: str, code: int) -> None:
    """Under --json a pipeline reads stdout: the error goes there too, as one JSON object."""
    args = sys.argv[1:] if argv is None else argv
    if "--json" in args:
        click.echo(json.dumps({"error": message, "exit": code}))


def main(argv: list[str] | None = None) -> None:
    if sys.stdout is None:  # started with stdout closed (`gpuprov schema >&-`): Python gives None
        _stdout_closed()
    if argv is None:  # a command run as a process (not a library caller's, nor a test's in-process call)
        _as_a_process()
    try:
        rc = cli.main(args=argv, prog_name="gpuprov", standalone_mode=False)
        sys.stdout.flush()  # here, not at interpreter exit, where a closed pipe prints "Exception ignored"
    except (_OutputClosed, BrokenPipeError):
        _silence_stdout()
        sys.exit(SIGPIPE_EXIT)
    except GpuprovError as exc:
        click.echo(f"gpuprov: error: {exc}", err=True)
        _json_error(argv, str(exc), exc.exit_code)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("gpuprov: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        code = 2 if exc.exit_code not in (0, 1) else exc.exit_code
        _json_error(argv, exc.format_message(), code)
        sys.exit(code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("gpuprov: interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one line, never exit 1
        _unexpected(exc)
    sys.exit(_exit_code(rc))


_PROCESS = {"gc_paused": False}


def _as_a_process() -> None:
    """What only a whole `gpuprov` process does: its searches may come from the user's cache (search_memo.py),
    pydantic runs no plugin, and the cyclic garbage collector waits while the command's modules load.

    Pydantic looks for plugins at the first model class by importing importlib.metadata (the email package,
    zipfile, csv) and reading every installed distribution's entry points: about 25 ms of every run, for
    plugins no gpuprov command uses. Its loader's answer when plugins are disabled
    (PYDANTIC_DISABLE_PLUGINS=__all__) is installed in its place before any model is built.
    Loading a command's modules allocates tens of thousands of objects that live until exit, which the
    collector would traverse again and again (10-25 ms of `plan`); they are frozen once loaded (get_command) and
    the collector resumes for what the command itself allocates (`up` runs for an hour)."""
    if gc.isenabled():
        gc.disable()
        _PROCESS["gc_paused"] = True
    from gpuprov.planning import search_memo

    search_memo.enable()
    name = "pydantic.plugin._loader"
    if name not in sys.modules:
        import types

        loader = types.ModuleType(name, "gpuprov: no pydantic plugins in a gpuprov process")
        loader.get_plugins = lambda: ()  # type: ignore[attr-defined]
        sys.modules[name] = loader


def _stdout_closed() -> None:
    """One line and exit 2 before any command runs: its output would have nowhere to go."""
    try:
        sys.stderr.write("gpuprov: error: standard output is closed; redirect it (> file, or > /dev/null)\n")
    except (OSError, ValueError, AttributeError):  # stderr closed as well
        pass
    sys.exit(2)


def _one_line(text: str, limit: int = 300) -> str:
    return clip(" ".join(str(text).split()), limit)


def _unexpected(exc: Exception) -> None:
    """An error no command turned into a GpuprovError: one line on stderr, exit 2."""
    if os.environ.get("GPUPROV_TRACEBACK"):
        raise exc
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        message = f"{exc.strerror or type(exc).__name__}{where}"
    else:
        message = f"unexpected {type(exc).__name__}: {exc}"
    try:
        sys.stderr.write(f"gpuprov: error: {_one_line(message)}\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass
    _silence_stdout()
    sys.exit(2)
