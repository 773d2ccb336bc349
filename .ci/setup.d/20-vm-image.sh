#!/usr/bin/env bash
# The `vm` tests' guest: qemu + debootstrap from apt (if missing), then the Debian bookworm image
# cached in .vm-cache/ (tests/vm/build_image.sh; ~3 minutes once, free afterwards).
# Never fails the suite: where this cannot be done the vm tests skip with the reason, loudly.
set -uo pipefail
cd "$(dirname "$0")/../.."

warn() { echo "WARNING: 20-vm-image: $* (the vm tests will be SKIPPED)" >&2; exit 0; }

need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
command -v qemu-img >/dev/null || need+=(qemu-utils)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
command -v ssh >/dev/null || need+=(openssh-client)
command -v ssh-keygen >/dev/null || need+=(openssh-client)
# the GPU roles' VM test builds signed stand-in apt repositories and a stand-in driver module
command -v gpg >/dev/null || need+=(gpg)
command -v dpkg-scanpackages >/dev/null || need+=(dpkg-dev)
command -v gcc >/dev/null || need+=(gcc)
dpkg-query -W python3-apt >/dev/null 2>&1 || need+=(python3-apt)  # copied into the minimal guest
if [ "${#need[@]}" -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        warn "missing ${need[*]} and not root to apt-get install them"
    fi
    command -v apt-get >/dev/null || warn "missing ${need[*]} and no apt-get"
    echo "20-vm-image: apt-get install ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -q && apt-get install -y -q --no-install-recommends "${need[@]}"; } >/tmp/20-vm-image-apt.log 2>&1 \
        || { tail -20 /tmp/20-vm-image-apt.log >&2; warn "apt-get install ${need[*]} failed"; }
fi

bash tests/vm/build_image.sh || warn "building the guest image failed"
