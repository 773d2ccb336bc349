#!/usr/bin/env bash
# Pinned torchtitan and the pure-Python packages its training path imports, for benchmarks/gpu_day.py
# --dry-run (tests/test_gpu_day.py) and --prepare: downloaded once into .cache/gpu-day.
set -euo pipefail
cd "$(dirname "$0")/../.."
python - <<'PY'
import sys
sys.path.insert(0, "benchmarks")
import gpu_day
print(len(gpu_day.fetch_titan()), "wheels in", gpu_day.CACHE)
PY
