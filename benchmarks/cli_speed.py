#!/usr/bin/env python3
"""Wall time of the CLI commands pipelines run, as a user runs them (a fresh process each time).

    python benchmarks/cli_speed.py [--runs 7] [--cache warm|cold|new|off] [--json] [--python PATH]

Each command runs `--runs` times in a new interpreter (`python -m gpuprov ...`, the same code path
as the `gpuprov` script), in rounds: each round runs every command once, so a change in the machine's
load reaches all of them alike. The table shows the median, the fastest and the slowest wall-clock
seconds, the median CPU seconds (user + system: steadier than wall time on a shared machine), plus
`python -c pass` as the floor any command pays, and each command as a multiple of `python -c "import
click, jinja2, pydantic"` (the libraries it stands on): fastest wall time and median CPU time. Compare
before/after on the same box; to time another checkout, copy this file into its benchmarks/ and run it
from there (it runs `python -m gpuprov` in its own repository, which comes first on sys.path).
`generate` writes into a fresh temporary folder every run.

The user cache (`$XDG_CACHE_HOME/gpuprov`: compiled templates, parsed catalogs, allocator replays, finished
searches, rendered bundles) lives in a temporary folder of the benchmark's own, never the user's; `--cache`
says what each timed run finds there:
  warm  what the untimed warm-up run of the same command left: the same question asked again (default)
  cold  nothing (a fresh empty folder every run): the first run on a machine
  new   what `plan`/`generate --model 8b` left (copied fresh for every run): a new question (model, flags)
        on a machine that ran gpuprov before, so catalogs and templates are cached but not the answer
  off   no cache at all (GPUPROV_NO_CACHE=1)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# (label, arguments after `python -m gpuprov`); "{out}" becomes a fresh output folder
BARE = "import click, jinja2, pydantic"  # the libraries every gpuprov command stands on: the ratios' base
COMMANDS: list[tuple[str, list[str]]] = [
    ("python -c pass (floor)", []),
    (f'python -c "{BARE}" (base)', ["-c", BARE]),
    ("gpuprov --help", ["--help"]),
    ("gpuprov plan --model 70b", ["plan", "--model", "70b"]),
    ("gpuprov plan --model 70b --json", ["plan", "--model", "70b", "--json"]),
    ("gpuprov generate --model 70b -o DIR", ["generate", "--model", "70b", "-o", "{out}"]),
]
# the other question a `--cache new` run's cache has seen (same commands, another model)
PRIMER = "70b", "8b"
MODES = ("warm", "cold", "new", "off")


def _cpu_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# Compiled bytecode as an installed package has it: the warm-up run writes .pyc files (into a folder of
# their own, not the checkout) and the timed runs read them. With PYTHONDONTWRITEBYTECODE set (some CI and
# sandbox images set it) every run would compile every module again and time the compiler instead.
_PYC = tempfile.mkdtemp(prefix="gpuprov-speed-pyc-")
ENV = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "GPUPROV_NO_CACHE")},
       "PYTHONPYCACHEPREFIX": _PYC}


def _argv(python: str, args: list[str], out: Path) -> list[str]:
    if not args or args[0] == "-c":  # the floor, or the bare imports the ratios divide by
        return [python, "-c", args[1] if args else "pass"]
    return [python, "-m", "gpuprov", *(a.replace("{out}", str(out)) for a in args)]


def _run(argv: list[str], cache: Path | None) -> tuple[float, float]:
    """(wall seconds, CPU seconds user+system) of one fresh process; `cache`: its XDG_CACHE_HOME (None: off)."""
    env = dict(ENV, XDG_CACHE_HOME=str(cache)) if cache is not None else dict(ENV, GPUPROV_NO_CACHE="1")
    cpu0, start = _cpu_children(), time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env=env)
    elapsed, cpu = time.perf_counter() - start, _cpu_children() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr}")
    return elapsed, cpu


class Runner:
    """Times one command under one cache mode; `prepare` does the untimed warm-up (and primes `new`'s cache)."""

    def __init__(self, python: str, args: list[str], mode: str, work: Path, index: int) -> None:
        self.python, self.args, self.mode = python, args, mode
        self.home = work / f"cmd{index}"
        self.home.mkdir()
        self.warm, self.primed = self.home / "warm-cache", self.home / "primed-cache"

    def prepare(self) -> None:
        self._once(self.warm)  # page cache and .pyc files; fills the warm cache; not counted
        self.primed.mkdir()
        if self.mode == "new" and self.args and self.args[0] != "-c":
            self._once(self.primed, [PRIMER[1] if a == PRIMER[0] and i and self.args[i - 1] == "--model" else a
                                     for i, a in enumerate(self.args)])

    def _once(self, cache: Path | None, args: list[str] | None = None) -> tuple[float, float]:
        out = self.home / "bundle"
        shutil.rmtree(out, ignore_errors=True)
        try:
            return _run(_argv(self.python, self.args if args is None else args, out), cache)
        finally:
            shutil.rmtree(out, ignore_errors=True)

    def timed(self) -> tuple[float, float]:
        if self.mode == "warm":
            return self._once(self.warm)
        if self.mode == "off":
            return self._once(None)
        fresh = self.home / "run-cache"
        shutil.rmtree(fresh, ignore_errors=True)
        shutil.copytree(self.primed, fresh)  # `cold`: the empty folder; `new`: the primed one
        try:
            return self._once(fresh)
        finally:
            shutil.rmtree(fresh, ignore_errors=True)


def measure(python: str, runs: int, mode: str) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="gpuprov-speed-") as tmp:
        runners = [Runner(python, cmd, mode, Path(tmp), i) for i, (_, cmd) in enumerate(COMMANDS)]
        for r in runners:
            r.prepare()
        samples: list[list[tuple[float, float]]] = [[] for _ in runners]
        for _ in range(max(1, runs)):  # rounds: every command once per round
            for r, got in zip(runners, samples):
                got.append(r.timed())
    rows = []
    for (label, _), runs_ in zip(COMMANDS, samples):
        times = [wall for wall, _ in runs_]
        rows.append({"command": label, "cache": mode, "median_s": statistics.median(times), "min_s": min(times),
                     "max_s": max(times), "cpu_median_s": statistics.median(cpu for _, cpu in runs_),
                     "runs": len(times)})
    base = rows[1]
    for r in rows:  # x the bare imports: wall (min, the least disturbed run) and CPU (steadier when shared)
        r["x_base_min"] = r["min_s"] / base["min_s"]
        r["x_base_cpu"] = r["cpu_median_s"] / base["cpu_median_s"]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7, help="runs per command (median reported)")
    ap.add_argument("--python", default=sys.executable, help="interpreter with gpuprov installed")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--cache", choices=MODES, default="warm", help="what each timed run finds in the user cache")
    ap.add_argument("--no-cache", action="store_true", help="the same as --cache off")
    args = ap.parse_args()
    rows = measure(args.python, args.runs, "off" if args.no_cache else args.cache)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["command"]) for r in rows)
    print(f"cache: {rows[0]['cache']}")
    print(f"{'command':<{width}}  {'median s':>8}  {'min s':>6}  {'max s':>6}  {'cpu s':>6}  {'x base':>6}  "
          f"{'x cpu':>6}  runs")
    for r in rows:
        print(f"{r['command']:<{width}}  {r['median_s']:8.3f}  {r['min_s']:6.3f}  {r['max_s']:6.3f}  "
              f"{r['cpu_median_s']:6.3f}  {r['x_base_min']:6.2f}  {r['x_base_cpu']:6.2f}  {r['runs']}")
    print(f"x base: fastest wall time / the fastest `python -c \"{BARE}\"`; x cpu: median CPU seconds / its "
          "median (targets: plan <= 2.5, generate <= 3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
