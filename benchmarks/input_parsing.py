#!/usr/bin/env python3
"""Time to read each input gpuprov parses, at its size cap, in every shape that used to be slow.

    python benchmarks/input_parsing.py [--runs 3] [--json]

Every input (spec, hosts file, train.yaml, gpuprov.lock, plan.json) is built at the 1 MiB input
cap (the lock and plan.json at 1 MiB too, well past any real one) in shapes that stress a parser:
a long list of hosts, one repeated key, a long comment, a long scalar, many numbers, an alias
bomb, deep block and flow nesting. Each row runs the real reader (accepted or refused with one
GpuprovError line, either is an answer) in this process and prints the median wall seconds of
`--runs` runs. `ruamel rt` is one ruamel.yaml round-trip load of the same text, the parser the
readers used before (three passes of it): the `ratio` column (reader / that one load) stays
meaningful on a busy machine where absolute seconds do not. The target: every row under 2 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CAP = 1 << 20


def _fit(text: str) -> str:
    """`text` cut to the cap at a line end."""
    text = text[:CAP]
    return text[:text.rfind("\n") + 1] if len(text) == CAP else text


def spec_inputs() -> dict[str, str]:
    hosts = "".join(f"  - {{name: gpu{i}, address: 10.0.{i % 250}.{i % 200}}}\n" for i in range(40000))
    return {
        "hosts list in a spec": _fit("model: 70b\ntokens: 20B\nhosts:\n" + hosts),
        "one key repeated": _fit("model: 70b\n" * 120000),
        "long comment": "model: 70b\n#" + "x" * (CAP - 14) + "\n",
        "long scalar": "model: " + "a" * (CAP - 9) + "\n",
        "many numbers": _fit("lora_targets:\n" + "".join(f"  - {i}.5\n" for i in range(200000))),
        "alias bomb": "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8)),
        "block nesting": _fit("".join("  " * i + f"k{i}:\n" for i in range(3000))),
        "flow nesting": "model: " + "[" * (CAP - 8) + "\n",
        "quoted brackets": _fit("model: 70b\nx:\n" + "".join(f"  - \"[{{{i}\"\n" for i in range(100000))),
    }


def _readers():
    from gpuprov import bundle
    from gpuprov.commands.status import _metrics_file
    from gpuprov.specfile import load_hosts, load_spec

    def train_yaml(path: Path) -> None:
        root = path.parent / "bundle"
        (root / "launch").mkdir(parents=True, exist_ok=True)
        (root / "launch" / "train.yaml").write_bytes(path.read_bytes())
        _metrics_file(root)

    def lock(path: Path) -> None:
        root = path.parent / "lockdir"
        root.mkdir(exist_ok=True)
        (root / bundle.LOCK_NAME).write_bytes(path.read_bytes())
        bundle.read_lock(root)

    def plan_json(path: Path) -> None:  # as validate, check and up read it
        bundle.parse_plan(path.read_text())

    return {"spec": load_spec, "hosts": load_hosts, "train.yaml": train_yaml}, {"lock": lock, "plan.json": plan_json}


def json_inputs() -> dict[str, str]:
    files = ",".join(f'"ansible/f{i}.yml": "{"0" * 64}"' for i in range(11000))
    return {
        "lock, many files": '{"lock_format": 1, "spec": {"model": "70b"}, "keep": [], "files": {' + files + "}}",
        "lock, deep nesting": '{"lock_format": 1, "files": {}, "spec": ' + "[" * (CAP // 2 - 50) + "]" * (CAP // 2 - 50) + "}",
        "plan.json, long list": '{"spec": {"hosts": [' + ",".join(['{"name": "a", "address": "b"}'] * 30000) + "]}}",
    }


def _time(function, path: Path, runs: int) -> tuple[float, str]:
    from gpuprov.errors import GpuprovError

    times, outcome = [], ""
    for _ in range(runs):
        start = time.perf_counter()
        try:
            function(path)
            outcome = "read"
        except GpuprovError as exc:
            outcome = "refused: " + str(exc).split(": ", 2)[-1][:48]
        except ValueError as exc:  # plan.json: pydantic's own error, which `up` turns into one line
            outcome = "refused: " + str(exc).splitlines()[0][:48]
        times.append(time.perf_counter() - start)
    return statistics.median(times), outcome


def _ruamel(text: str) -> float:
    from ruamel.yaml import YAML

    start = time.perf_counter()
    try:
        YAML(typ="rt").load(text)
    except Exception:  # noqa: BLE001 - only the time matters here
        pass
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-ruamel", action="store_true", help="skip the (slow) ruamel round-trip comparison")
    args = parser.parse_args()
    yaml_readers, json_readers = _readers()
    rows = []
    with tempfile.TemporaryDirectory() as temp:
        for shape, text in spec_inputs().items():
            path = Path(temp) / "input.yaml"
            path.write_text(text)
            base = None if args.no_ruamel or "nesting" in shape or "bomb" in shape else _ruamel(text)
            for name, reader in yaml_readers.items():
                seconds, outcome = _time(reader, path, args.runs)
                rows.append({"input": name, "shape": shape, "bytes": len(text.encode()), "seconds": seconds,
                             "ruamel_rt": base, "outcome": outcome})
        for shape, text in json_inputs().items():
            path = Path(temp) / "input.json"
            path.write_text(text)
            for name, reader in json_readers.items():
                if not shape.startswith(name.split(".")[0].split(",")[0]):
                    continue
                seconds, outcome = _time(reader, path, args.runs)
                rows.append({"input": name, "shape": shape, "bytes": len(text.encode()), "seconds": seconds,
                             "ruamel_rt": None, "outcome": outcome})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'input':10s} {'shape':22s} {'bytes':>9s} {'seconds':>8s} {'ruamel rt':>9s} {'ratio':>6s}  outcome")
    for row in rows:
        base = f"{row['ruamel_rt']:9.2f}" if row["ruamel_rt"] else f"{'-':>9s}"
        ratio = f"{row['seconds'] / row['ruamel_rt']:6.3f}" if row["ruamel_rt"] else f"{'-':>6s}"
        print(f"{row['input']:10s} {row['shape']:22s} {row['bytes']:9d} {row['seconds']:8.3f} {base} {ratio}  {row['outcome']}")
    slowest = max(rows, key=lambda r: r["seconds"])
    print(f"\nslowest: {slowest['input']} / {slowest['shape']} in {slowest['seconds']:.2f} s (target: under 2 s)")


if __name__ == "__main__":
    main()
