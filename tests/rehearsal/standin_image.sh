#!/bin/sh
# The image and the instance the stand-in node plays, as far as the roles look: the image's OS
# release (the image profile's; the packages stay Debian 12's, which the rehearsal states) and the
# instance's NVIDIA GPUs on the PCI bus (vendor 0x10de, 3D controller) beside the guest's own
# devices, over /sys/bus/pci/devices. Arguments: OS_ID OS_VERSION OS_CODENAME GPU_COUNT PCI_DEVICE_ID
set -e
os_id=$1 os_version=$2 codename=$3 gpus=$4 device=$5
if [ "$os_id" = ubuntu ]; then
    rm -f /etc/os-release
    cat >/etc/os-release <<REL
PRETTY_NAME="Ubuntu $os_version LTS"
NAME="Ubuntu"
VERSION_ID="$os_version"
VERSION="$os_version LTS"
VERSION_CODENAME=$codename
ID=ubuntu
ID_LIKE=debian
UBUNTU_CODENAME=$codename
REL
    printf 'DISTRIB_ID=Ubuntu\nDISTRIB_RELEASE=%s\nDISTRIB_CODENAME=%s\n' "$os_version" "$codename" >/etc/lsb-release
fi
# the cloud images run cloud-init: its drop-in folder is there (this image has no cloud-init itself)
mkdir -p /etc/cloud/cloud.cfg.d
if ! mountpoint -q /sys/bus/pci/devices; then
    tree=/run/standin-pci
    mkdir -p $tree
    mount -t tmpfs standin-pci $tree
    for dev in /sys/bus/pci/devices/*; do ln -s "$(readlink -f "$dev")" "$tree/${dev##*/}"; done
    i=0
    while [ $i -lt "$gpus" ]; do
        slot=$(printf '0000:%02x:00.0' $((0x10 + i)))
        mkdir -p "$tree/$slot"
        echo 0x10de >"$tree/$slot/vendor"; echo "$device" >"$tree/$slot/device"; echo 0x030200 >"$tree/$slot/class"
        i=$((i + 1))
    done
    mount --bind $tree /sys/bus/pci/devices
fi
