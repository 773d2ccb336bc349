#!/usr/bin/env python3
"""Regenerate every example bundle: examples/<name>/gpuprov.yaml (+ hosts.yaml) -> examples/<name>/bundle/.

    python scripts/regen_examples.py            # rewrite the bundles
    python scripts/regen_examples.py --check    # exit 1 if any bundle would change (what CI runs)

The same code path as `gpuprov generate -f gpuprov.yaml [--hosts hosts.yaml] -o bundle` and
`gpuprov check bundle`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example_dirs() -> list[Path]:
    return sorted(p.parent for p in EXAMPLES.glob("*/gpuprov.yaml"))


def example_spec(directory: Path):
    from gpuprov.commands.spec_options import spec_from_flags

    hosts = directory / "hosts.yaml"
    return spec_from_flags(str(directory / "gpuprov.yaml"), str(hosts) if hosts.is_file() else None, {})


def example_files(directory: Path) -> dict[str, str]:
    from gpuprov import bundle
    from gpuprov.commands.generate import make_plan

    return bundle.build_bundle(make_plan(example_spec(directory)))


def main(argv: list[str] | None = None) -> int:
    from gpuprov import bundle
    from gpuprov.errors import GpuprovError

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on any difference")
    parser.add_argument("names", nargs="*", help="examples to process (default: all)")
    args = parser.parse_args(argv)
    status = 0
    for directory in example_dirs():
        if args.names and directory.name not in args.names:
            continue
        started = time.perf_counter()
        try:
            files = example_files(directory)
        except GpuprovError as exc:
            print(f"{directory.name}: error: {exc}", file=sys.stderr)
            status = 2
            continue
        target = directory / "bundle"
        if args.check:
            differences = bundle.compare_bundle(target, files)
            for d in differences:
                print(f"{directory.name}: {d.status} {d.path}")
            status = max(status, 1 if differences else 0)
            continue
        bundle.write_bundle(target, files, force=True)
        print(f"{directory.name}: {len(files)} files in {time.perf_counter() - started:.2f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
