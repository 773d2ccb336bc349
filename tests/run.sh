#!/usr/bin/env bash
# The full test suite from a clean checkout: creates .venv, installs gpuprov with every test
# dependency (CPU PyTorch pinned to the wheel these machines cache), runs each setup step in
# .ci/setup.d/ (checkov's own venv, the VM image), then pytest: the tests without guests on both cores,
# then the VM tests. Extra arguments go to one plain pytest run instead.
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

# The setup steps run apt-get, whose sandboxed user (_apt) writes its temporary files in $TMPDIR: where
# that is root's alone (mode 700: fresh machines have had both /tmp and /var/tmp so) its signature
# checks fail, so they get the first of $TMPDIR, /tmp, /var/tmp and /dev/shm that everyone may write, or
# where all are private (a CI machine had all three so) the suite's own, as the Slurm tests use it.
own_scratch=${GPUPROV_SCRATCH:-/var/lib/gpuprov-scratch}
setup_tmp=""
for candidate in "${TMPDIR:-/tmp}" /tmp /var/tmp /dev/shm; do
    if [ "$(stat -c %a "$candidate" 2>/dev/null)" = 1777 ]; then
        setup_tmp=$candidate
        break
    fi
done
if [ -z "$setup_tmp" ]; then
    mkdir -p "$own_scratch" && chmod 1777 "$own_scratch"
    setup_tmp=$own_scratch
fi
for step in .ci/setup.d/*.sh; do
    [ -e "$step" ] || continue
    echo "== setup: $step"
    TMPDIR="$setup_tmp" bash "$step"
done
# Bytecode for the checkout's own sources, once (compileall writes it whatever the environment says): where
# PYTHONDONTWRITEBYTECODE is set, as on some CI and sandbox images, every Python process the tests start (each
# CLI run, each trainer rank) would otherwise compile every gpuprov and trainer module it imports again.
python -m compileall -q -j 0 gpuprov templates tests benchmarks scripts > /dev/null

if [ "$#" -gt 0 ]; then
    exec python -m pytest "$@"
fi
# The whole suite in three passes: the tests without guests on both cores (pytest-xdist, each file on
# one worker: files that share a fixture or a daemon stay together), then the rehearsal
# (GPUPROV_REHEARSAL: ci by default, the default cloud's from-scratch bundle; all; 0), then the other
# qemu tests (GPUPROV_VM: ci by default; all), their two files side by side: the GPU roles' two
# guests and the NVMe RAID guest. Every pass runs; the run fails if any does.
# CI stops a run at 90 minutes. A guest pass starts only where its allowance (its time on a loaded 2-core
# host and a margin: REHEARSAL_PASS_MIN, VM_PASS_MIN) still fits before minute RUN_LIMIT_MIN, counted
# from this script's start (installs included), and is stopped there; a pass that does not fit is
# skipped and says so.
status=0
run_limit=$(( ${RUN_LIMIT_MIN:-86} * 60 ))
guest_pass() {  # NAME ALLOWANCE_MINUTES PYTEST_ARGS...
    local name=$1 allowance=$2 left=$(( run_limit - SECONDS ))
    shift 2
    if [ "$left" -lt $(( allowance * 60 )) ]; then
        echo "WARNING: $name SKIPPED: $(( SECONDS / 60 )) min had passed, it is allowed $allowance and the run stops at minute $(( run_limit / 60 ))" >&2
        return 0
    fi
    timeout --signal=INT --kill-after=60 "$left" python -m pytest "$@" || status=$?
}
python -m pytest -m "not vm" -n 2 --dist loadfile || status=$?
if [ "${GPUPROV_REHEARSAL:-ci}" != 0 ]; then
    guest_pass "THE REHEARSAL" "${REHEARSAL_PASS_MIN:-45}" -m rehearsal -rP  # -rP: each phase's time, also when it passes
fi
guest_pass "THE VM TESTS" "${VM_PASS_MIN:-24}" -m "vm and not rehearsal" -n 2 --dist loadfile
exit "$status"
