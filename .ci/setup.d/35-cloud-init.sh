#!/usr/bin/env bash
# cloud-init's own code for the slurm role's hosts test (tests/cloud_init_boot.py): Debian 12's
# cloud-init package and the Python packages it imports, downloaded and unpacked into one folder, not
# installed (nothing on this machine changes, no cloud-init runs here). Never fails the suite: without
# it that test skips with the reason, loudly.
set -uo pipefail

tree=${GPUPROV_CLOUD_INIT_TREE:-/var/tmp/gpuprov-cloud-init}
warn() { echo "WARNING: 35-cloud-init: $* (the cloud-init boot test will be SKIPPED)" >&2; exit 0; }

if [ -f "$tree/usr/lib/python3/dist-packages/cloudinit/config/cc_update_etc_hosts.py" ]; then
    echo "35-cloud-init: $tree present"
    exit 0
fi
command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || warn "no apt-get/dpkg-deb"
work=$(mktemp -d)
trap 'rm -rf "$work" "$tree.new"' EXIT
chmod 755 "$work"  # apt's download user writes there
cd "$work" || warn "no scratch folder"
pkgs=(cloud-init python3-requests python3-urllib3 python3-idna python3-certifi python3-charset-normalizer
      python3-configobj python3-six python3-jsonpatch python3-json-pointer)
for attempt in 1 2 3; do  # the package lists may be missing or apt locked for a moment
    apt-get download "${pkgs[@]}" >download.log 2>&1 && break
    [ "$(id -u)" = 0 ] && apt-get update -q >/dev/null 2>&1
    sleep $((attempt * 5))
done
[ "$(ls ./*.deb 2>/dev/null | wc -l)" -eq "${#pkgs[@]}" ] || warn "apt-get download failed: $(tail -1 download.log)"
mkdir -p "$tree.new"
for deb in ./*.deb; do dpkg-deb -x "$deb" "$tree.new" || warn "cannot unpack $deb"; done
rm -rf "$tree" && mv "$tree.new" "$tree" || warn "cannot write $tree"
echo "35-cloud-init: unpacked $(ls ./*.deb | sed 's|^\./||' | tr '\n' ' ')into $tree"
