#!/usr/bin/env bash
# checkov in its own virtual environment (.checkov-venv at the repo root, gitignored): it pins old
# packaging/boto3 that break pytest when installed beside it. Idempotent: a venv already holding
# the pinned version is left alone. tests/test_checkov.py runs it offline.
set -euo pipefail
cd "$(dirname "$0")/../.."

CHECKOV_VERSION=3.3.30
VENV=.checkov-venv

if [ -x "$VENV/bin/checkov" ] && [ "$("$VENV/bin/checkov" --version 2>/dev/null)" = "$CHECKOV_VERSION" ]; then
    echo "checkov $CHECKOV_VERSION already in $VENV"
    exit 0
fi
# The base interpreter, not the project's .venv, so the two environments share nothing.
BASE_PYTHON=$(python3 -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')
rm -rf "$VENV"
"$BASE_PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "checkov==$CHECKOV_VERSION"
"$VENV/bin/checkov" --version
