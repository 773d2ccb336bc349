#!/usr/bin/env bash
# Build (once) the Debian bookworm guest used by the `vm` tests: a raw ext4 root image plus the
# kernel and initrd to boot it with qemu -kernel/-initrd. No loop mount is needed (mkfs.ext4 -d),
# so it works in containers; debootstrap needs root. Output goes to $VM_CACHE (default
# <repo>/.vm-cache/bookworm); a stamp holding this script's hash makes reruns free and rebuilds
# when the recipe changes; a copy kept in the machine's store ($VM_IMAGE_STORE) serves the next checkout.
# Tests boot a qcow2 overlay on top, so the cached image stays clean.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${VM_CACHE:-$repo/.vm-cache/bookworm}
stamp="$cache/stamp"
# VM_EXTRA_PACKAGES (comma-separated): more Debian packages in the image (the rehearsal's Slurm guests)
extra=${VM_EXTRA_PACKAGES:-}
recipe_hash=$({ cat "$0"; echo "$extra"; } | sha256sum | cut -d' ' -f1)

complete() { [ -f "$1/root.img" ] && [ -f "$1/vmlinuz" ] && [ -f "$1/initrd.img" ]; }
fresh() {  # a complete stored image whose stamp (kept with the build's time) is young enough
    complete "$1" && [ -n "$(find "$1/stamp" -mtime -"${VM_IMAGE_MAX_AGE_DAYS:-7}" 2>/dev/null)" ]
}
# The machine's store, shared by every checkout (CI clones afresh): an image of this recipe built there
# within VM_IMAGE_MAX_AGE_DAYS (Debian's packages move on) is copied in instead of built again.
# VM_IMAGE_STORE= (empty) turns it off.
store=${VM_IMAGE_STORE-/var/cache/gpuprov-vm}
stored=${store:+$store/$recipe_hash}
keep() {  # this checkout's image into the store, where it is not there yet; optional
    [ -n "$stored" ] && fresh "$cache" && ! fresh "$stored" && mkdir -p "$store" 2>/dev/null || return 0
    { rm -rf "$stored.new" && mkdir -p "$stored.new" \
        && for f in root.img vmlinuz initrd.img stamp; do cp -p --sparse=always "$cache/$f" "$stored.new/$f"; done \
        && rm -rf "$stored" && mv "$stored.new" "$stored" && echo "vm image: stored at $stored"; } \
        || { rm -rf "$stored.new"; echo "vm image: not stored at $store (kept only at $cache)" >&2; }
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$recipe_hash" ] && complete "$cache"; then
    echo "vm image: cached at $cache"
    keep
    exit 0
fi
if [ -n "$stored" ] && fresh "$stored"; then
    rm -rf "$cache.copy" && mkdir -p "$cache.copy"
    for f in root.img vmlinuz initrd.img; do cp --sparse=always "$stored/$f" "$cache.copy/$f"; done
    cp -p "$stored/stamp" "$cache.copy/stamp"
    rm -rf "$cache" && mv "$cache.copy" "$cache"
    echo "vm image: copied from $stored (built $(date -u -r "$stored/stamp" +%F))"
    exit 0
fi

if [ "$(id -u)" != 0 ]; then
    echo "vm image: debootstrap needs root; not building (vm tests will skip)" >&2
    exit 1
fi
for tool in debootstrap mkfs.ext4 qemu-img; do
    command -v "$tool" >/dev/null || { echo "vm image: $tool missing" >&2; exit 1; }
done

# The host's configured Debian mirror (deb822 or one-line sources), else the public one.
mirror=${VM_DEBIAN_MIRROR:-}
if [ -z "$mirror" ]; then
    mirror=$(grep -hs -E '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list \
                 /etc/apt/sources.list 2>/dev/null \
             | grep -E 'debian/?$|debian ' | grep -v security | head -1 \
             | sed -E 's/^URIs: *//; s/^deb (\[[^]]*\] )?//; s/ .*//' || true)
fi
mirror=${mirror:-http://deb.debian.org/debian}

# dbus: the clouds' images run it, and `shutdown -r` (Ansible's reboot module) asks logind over it
packages=linux-image-amd64,systemd-sysv,udev,kmod,openssh-server,mdadm,python3,iproute2,nvme-cli,xfsprogs,util-linux,e2fsprogs,dbus
packages=$packages${extra:+,$extra}
work="$cache.build"
rm -rf "$work"
mkdir -p "$work"
rootfs="$work/rootfs"
start=$(date +%s)
echo "vm image: debootstrap bookworm from $mirror"
debootstrap --variant=minbase --include="$packages" bookworm "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -30 "$work/debootstrap.log" >&2; exit 1; }

# Guest configuration: DHCP on the user-mode NIC, root on the virtio disk, serial console.
echo nvme-vm >"$rootfs/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 nvme-vm\n' >"$rootfs/etc/hosts"
printf '/dev/vda / ext4 rw,errors=remount-ro 0 1\n' >"$rootfs/etc/fstab"
mkdir -p "$rootfs/etc/systemd/network"
printf '[Match]\nName=eth0\n\n[Network]\nDHCP=ipv4\n' >"$rootfs/etc/systemd/network/10-eth0.network"
ln -sf /lib/systemd/system/systemd-networkd.service \
    "$rootfs/etc/systemd/system/multi-user.target.wants/systemd-networkd.service"
# Per-run SSH key: the harness passes the public key on the kernel command line
# (gpuprov.sshkey=<base64>); this unit installs it before sshd starts.
cat >"$rootfs/usr/local/sbin/install-ssh-key" <<'KEY'
#!/bin/sh
set -e
key=$(tr ' ' '\n' </proc/cmdline | sed -n 's/^gpuprov\.sshkey=//p')
[ -n "$key" ] || exit 0
mkdir -p /root/.ssh && chmod 700 /root/.ssh
echo "$key" | base64 -d >/root/.ssh/authorized_keys
chmod 600 /root/.ssh/authorized_keys
KEY
chmod 755 "$rootfs/usr/local/sbin/install-ssh-key"
cat >"$rootfs/etc/systemd/system/install-ssh-key.service" <<'UNIT'
[Unit]
Description=Install the test harness SSH key from the kernel command line
Before=ssh.service

[Service]
Type=oneshot
ExecStart=/usr/local/sbin/install-ssh-key

[Install]
WantedBy=multi-user.target
UNIT
ln -sf /etc/systemd/system/install-ssh-key.service \
    "$rootfs/etc/systemd/system/multi-user.target.wants/install-ssh-key.service"
# Faster boots under emulation: no DNS wait, no periodic timers doing work mid-test.
rm -f "$rootfs"/etc/systemd/system/timers.target.wants/*
ln -sf /dev/null "$rootfs/etc/systemd/system/systemd-networkd-wait-online.service"
# sshd: key auth only (root login with a key is Debian's default).
echo 'PasswordAuthentication no' >"$rootfs/etc/ssh/sshd_config.d/10-test.conf"
echo 'UseDNS no' >>"$rootfs/etc/ssh/sshd_config.d/10-test.conf"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*_Packages

kernel=$(ls "$rootfs"/boot/vmlinuz-* | sort -V | tail -1)
initrd=$(ls "$rootfs"/boot/initrd.img-* | sort -V | tail -1)
cp "$kernel" "$work/vmlinuz"
cp "$initrd" "$work/initrd.img"
mkfs.ext4 -q -L root -d "$rootfs" "$work/root.img" 3G
rm -rf "$rootfs"
rm -rf "$cache"
mv "$work" "$cache"
echo "$recipe_hash" >"$stamp"
echo "vm image: built in $(( $(date +%s) - start ))s at $cache"
keep
