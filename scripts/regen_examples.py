#!/usr/bin/env python3
"""Regenerate the examples: examples/<name>/gpuprov.yaml (+ hosts.yaml) -> what the example shows.

    python scripts/regen_examples.py            # rewrite them
    python scripts/regen_examples.py --check    # exit 1 if any would change (what the tests run)

One example (FULL_BUNDLE) keeps its whole bundle in examples/<name>/bundle/, so a reader sees every
file gpuprov writes; the others keep what tells a user something about their case (plan.json, the
bundle's README.md) and the tests generate the rest. The same code path as
`gpuprov generate -f gpuprov.yaml [--hosts hosts.yaml] -o bundle` and `gpuprov check bundle`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
FULL_BUNDLE = "70b-full-aws-p5"
SHOWN = ("plan.json", "README.md")  # what the other examples keep of their bundle


def example_dirs() -> list[Path]:
    return sorted(p.parent for p in EXAMPLES.glob("*/gpuprov.yaml"))


def example_spec(directory: Path):
    from gpuprov.commands.spec_options import spec_from_flags

    hosts = directory / "hosts.yaml"
    return spec_from_flags(str(directory / "gpuprov.yaml"), str(hosts) if hosts.is_file() else None, {})


def example_files(directory: Path) -> dict[str, str]:
    """Every file of the example's bundle, generated now."""
    from gpuprov import bundle
    from gpuprov.commands.generate import make_plan

    return bundle.build_bundle(make_plan(example_spec(directory)))


def committed_files(directory: Path, files: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """Where the example's committed files live and which of the generated files they are."""
    if directory.name == FULL_BUNDLE:
        return directory / "bundle", files
    return directory / "shown", {name: files[name] for name in SHOWN}


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
            target, files = committed_files(directory, example_files(directory))
        except GpuprovError as exc:
            print(f"{directory.name}: error: {exc}", file=sys.stderr)
            status = 2
            continue
        if args.check:
            differences = bundle.compare_bundle(target, files) if target.name == "bundle" else [
                name for name, text in files.items()
                if not (target / name).is_file() or (target / name).read_text() != text]
            for d in differences:
                print(f"{directory.name}: {getattr(d, 'status', 'changed')} {getattr(d, 'path', d)}")
            status = max(status, 1 if differences else 0)
            continue
        if target.name == "bundle":
            bundle.write_bundle(target, files, force=True)
        else:
            target.mkdir(exist_ok=True)
            for name, text in files.items():
                (target / name).write_text(text)
        print(f"{directory.name}: {len(files)} files in {time.perf_counter() - started:.2f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
