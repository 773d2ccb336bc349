#!/usr/bin/env python3
"""Wall time of the CLI commands pipelines run, as a user runs them (a fresh process each time).

    python benchmarks/cli_speed.py [--runs 7] [--json] [--python PATH] [--no-cache]

Each command runs `--runs` times in a new interpreter (`python -m gpuprov ...`, the same code path
as the `gpuprov` script); the table shows the median, the fastest and the slowest wall-clock
seconds, the median CPU seconds (user + system: steadier than wall time on a shared machine), plus
`python -c pass` as the floor any command pays, and each command as a multiple of `python -c "import
click, jinja2, pydantic"` (the libraries it stands on): fastest wall time and median CPU time. Compare before/after on the same box; to time
another checkout, copy this file into its benchmarks/ and run it from there (it runs `python -m
gpuprov` in its own repository, which comes first on sys.path). `generate` writes
into a fresh temporary folder every run. The warm-up run also fills the user cache (`~/.cache/gpuprov`:
compiled templates, parsed catalogs, allocator replays), as any earlier run of gpuprov does; `--no-cache`
times every run without it (GPUPROV_NO_CACHE=1), as a first run on a fresh machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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


def _cpu_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# Compiled bytecode as an installed package has it: the warm-up run writes .pyc files (into a folder of
# their own, not the checkout) and the timed runs read them. With PYTHONDONTWRITEBYTECODE set (some CI and
# sandbox images set it) every run would compile every module again and time the compiler instead.
_PYC = tempfile.mkdtemp(prefix="gpuprov-speed-pyc-")
ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "PYTHONPYCACHEPREFIX": _PYC}


def _time_once(python: str, args: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds user+system) of one fresh process."""
    with tempfile.TemporaryDirectory(prefix="gpuprov-speed-") as tmp:
        if not args or args[0] == "-c":  # the floor, or the bare imports the ratios divide by
            argv = [python, "-c", args[1] if args else "pass"]
        else:
            argv = [python, "-m", "gpuprov", *(a.replace("{out}", str(Path(tmp) / "bundle")) for a in args)]
        cpu0, start = _cpu_children(), time.perf_counter()
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env=ENV)
        elapsed, cpu = time.perf_counter() - start, _cpu_children() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr}")
    return elapsed, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7, help="runs per command (median reported)")
    ap.add_argument("--python", default=sys.executable, help="interpreter with gpuprov installed")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--no-cache", action="store_true", help="run without the user cache (GPUPROV_NO_CACHE=1)")
    args = ap.parse_args()
    if args.no_cache:
        ENV["GPUPROV_NO_CACHE"] = "1"

    rows = []
    for label, cmd in COMMANDS:
        _time_once(args.python, cmd)  # warm the page cache and .pyc files; not counted
        runs = [_time_once(args.python, cmd) for _ in range(max(1, args.runs))]
        times = [wall for wall, _ in runs]
        rows.append({"command": label, "median_s": statistics.median(times), "min_s": min(times),
                     "max_s": max(times), "cpu_median_s": statistics.median(cpu for _, cpu in runs),
                     "runs": len(times)})

    base = rows[1]
    for r in rows:  # x the bare imports: wall (min, the least disturbed run) and CPU (steadier when shared)
        r["x_base_min"] = r["min_s"] / base["min_s"]
        r["x_base_cpu"] = r["cpu_median_s"] / base["cpu_median_s"]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["command"]) for r in rows)
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
