#!/usr/bin/env python3
"""The throughput model on its fresh hold-out: published runs no other benchmark file or catalog figure uses.

    python benchmarks/fresh_holdout.py [--json] [--model ops|utilisation]

Reads benchmarks/fresh-holdout-throughput.yaml (assembled 2026-12-06 with each row's settings written from its
source before the model was run on it) and predicts every row from its stated settings with the planner's own
step model, exactly as benchmarks/throughput.py does for its files (same predict/evaluate). Prints each row's
signed error (positive = predicted too fast), the MAPE and the worst too-fast row, against the issue's targets
(MAPE <= 12%, none more than 20% too fast). Nothing reads this file to set a figure: it measures the model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import throughput  # noqa: E402  (benchmarks/throughput.py: the same row format and step model)

FRESH = REPO / "benchmarks" / "fresh-holdout-throughput.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--model", choices=("ops", "utilisation"), default="ops")
    args = parser.parse_args(argv)
    results = throughput.evaluate(throughput.load_rows(FRESH), args.model)
    s = throughput.summary(results)
    if args.json:
        print(json.dumps({"rows": results, "summary": s}, indent=2))
        return 0
    print(throughput.render("fresh hold-out", results))
    print(f"\ntargets: MAPE <= {throughput.TARGET_MAPE:.0f}% (now {s['mape_pct']:.1f}%), no row more than "
          f"{throughput.TARGET_WORST_OVER:.0f}% too fast (now {s['worst_over_pct']:+.1f}%, {s['worst_over_id']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
