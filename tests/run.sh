#!/usr/bin/env bash
# The full test suite from a clean checkout: creates .venv, installs gpuprov with every test
# dependency (CPU PyTorch pinned to the wheel these machines cache), runs each setup step in
# .ci/setup.d/ (checkov's own venv, the VM image), then pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e '.[test,train,precise]'

for step in .ci/setup.d/*.sh; do
    [ -e "$step" ] || continue
    echo "== setup: $step"
    bash "$step"
done

exec python -m pytest "$@"
