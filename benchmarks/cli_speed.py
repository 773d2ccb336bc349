#!/usr/bin/env python3
"""Wall time of the CLI commands pipelines run, as a user runs them (a fresh process each time).

    python benchmarks/cli_speed.py [--runs 7] [--json] [--python PATH]

Each command runs `--runs` times in a new interpreter (`python -m gpuprov ...`, the same code path
as the `gpuprov` script); the table shows the median, the fastest and the slowest wall-clock
seconds, the median CPU seconds (user + system: steadier than wall time on a shared machine), plus
`python -c pass` as the floor any command pays. Compare before/after on the same box; to time
another checkout, copy this file into its benchmarks/ and run it from there (it runs `python -m
gpuprov` in its own repository, which comes first on sys.path). `generate` writes
into a fresh temporary folder every run.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# (label, arguments after `python -m gpuprov`); "{out}" becomes a fresh output folder
COMMANDS: list[tuple[str, list[str]]] = [
    ("python -c pass (floor)", []),
    ("gpuprov --help", ["--help"]),
    ("gpuprov plan --model 70b", ["plan", "--model", "70b"]),
    ("gpuprov plan --model 70b --json", ["plan", "--model", "70b", "--json"]),
    ("gpuprov generate --model 70b -o DIR", ["generate", "--model", "70b", "-o", "{out}"]),
]


def _cpu_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _time_once(python: str, args: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds user+system) of one fresh process."""
    with tempfile.TemporaryDirectory(prefix="gpuprov-speed-") as tmp:
        argv = [python, "-c", "pass"] if not args else \
            [python, "-m", "gpuprov", *(a.replace("{out}", str(Path(tmp) / "bundle")) for a in args)]
        cpu0, start = _cpu_children(), time.perf_counter()
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
        elapsed, cpu = time.perf_counter() - start, _cpu_children() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr}")
    return elapsed, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7, help="runs per command (median reported)")
    ap.add_argument("--python", default=sys.executable, help="interpreter with gpuprov installed")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args()

    rows = []
    for label, cmd in COMMANDS:
        _time_once(args.python, cmd)  # warm the page cache and .pyc files; not counted
        runs = [_time_once(args.python, cmd) for _ in range(max(1, args.runs))]
        times = [wall for wall, _ in runs]
        rows.append({"command": label, "median_s": statistics.median(times), "min_s": min(times),
                     "max_s": max(times), "cpu_median_s": statistics.median(cpu for _, cpu in runs),
                     "runs": len(times)})

    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["command"]) for r in rows)
    print(f"{'command':<{width}}  {'median s':>8}  {'min s':>6}  {'max s':>6}  {'cpu s':>6}  runs")
    for r in rows:
        print(f"{r['command']:<{width}}  {r['median_s']:8.3f}  {r['min_s']:6.3f}  {r['max_s']:6.3f}  "
              f"{r['cpu_median_s']:6.3f}  {r['runs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
