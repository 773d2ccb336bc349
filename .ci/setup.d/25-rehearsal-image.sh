#!/usr/bin/env bash
# The rehearsal's guest (tests/rehearsal/): the vm image recipe with Debian's Slurm, munge, sudo
# and python3-apt added, cached in .vm-cache/bookworm-slurm (~2-3 minutes once, free afterwards).
# Never fails the suite: where this cannot be done the rehearsal skips with the reason, loudly.
set -uo pipefail
cd "$(dirname "$0")/../.."
warn() { echo "WARNING: 25-rehearsal-image: $* (the rehearsal will be SKIPPED)" >&2; exit 0; }
# GPUPROV_REHEARSAL=0 runs no rehearsal (README: the rehearsal)
[ "${GPUPROV_REHEARSAL:-ci}" != 0 ] || { echo "25-rehearsal-image: skipped (GPUPROV_REHEARSAL=0)"; exit 0; }
command -v qemu-system-x86_64 >/dev/null || warn "qemu-system-x86_64 missing (20-vm-image.sh installs it)"
command -v debootstrap >/dev/null || warn "debootstrap missing (20-vm-image.sh installs it)"
VM_CACHE="$PWD/.vm-cache/bookworm-slurm" VM_EXTRA_PACKAGES="slurm-wlm,munge,nfs-common,sudo,python3-apt,procps" \
    bash tests/vm/build_image.sh || warn "building the rehearsal image failed"
