#!/bin/sh
# The image and the instance the stand-in node plays, as far as the roles look: the image's OS
# release (the image profile's; the packages stay Debian 12's, which the rehearsal states) and the
# instance's NVIDIA GPUs on the PCI bus (vendor 0x10de, 3D controller) beside the guest's own
# devices, over /sys/bus/pci/devices, and the image's own /usr/bin/nvidia-smi answering for them
# (below). Arguments: OS_ID OS_VERSION OS_CODENAME GPU_COUNT PCI_DEVICE_ID GPU_NAME GPU_MEMORY_MIB
# DRIVER_VERSION
set -e
os_id=$1 os_version=$2 codename=$3 gpus=$4 device=$5 gpu_name=$6 gpu_mib=$7 driver=$8
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
# The image's nvidia-smi (the DLAMI has the driver's at /usr/bin/nvidia-smi), answering the queries
# the bundle makes (node-health.sh: -L; prolog/epilog: --query-compute-apps; the driver and health
# roles: --query-gpu) in the real tool's formats: `-L` lines "GPU i: NAME (UUID: GPU-...)"; CSV with
# ", " between fields, a header of the field names unless noheader, memory as "N MiB" unless nounits,
# bus ids as 00000000:BB:DD.F (nvidia-smi --help-query-gpu, --help-query-compute-apps). No process
# computes on these GPUs, so the compute-apps list is empty. Anything else fails as an unknown
# field/option does (exit 2): a query the bundle starts to make shows up here first.
if [ "$gpus" -gt 0 ]; then
    cat >/usr/bin/nvidia-smi <<SMI
#!/bin/sh
# rehearsal stand-in for the instance's $gpus x $gpu_name (driver $driver); see standin_image.sh
gpus=$gpus name="$gpu_name" mib=$gpu_mib driver=$driver
SMI
    cat >>/usr/bin/nvidia-smi <<'SMI'
uuid() { printf 'GPU-%08x-0000-4000-8000-%012x' "$(( $(hostname | cksum | cut -d' ' -f1) ))" "$1"; }
field() {  # $1 field, $2 gpu index, $3 nounits
    case $1 in
        index) echo "$2" ;;
        name|gpu_name) echo "$name" ;;
        uuid|gpu_uuid) uuid "$2" ;;
        driver_version) echo "$driver" ;;
        count) echo "$gpus" ;;
        pci.bus_id|gpu_bus_id) printf '00000000:%02X:00.0' $((0x10 + $2)) ;;
        persistence_mode) echo Enabled ;;
        memory.total) [ -n "$3" ] && echo "$mib" || echo "$mib MiB" ;;
        *) return 1 ;;
    esac
}
query= fmt= apps=
for arg in "$@"; do
    case $arg in
        -L|--list-gpus) i=0; while [ $i -lt $gpus ]; do echo "GPU $i: $name (UUID: $(uuid $i))"; i=$((i + 1)); done; exit 0 ;;
        --query-gpu=*) query=${arg#--query-gpu=} ;;
        --query-compute-apps=*) apps=${arg#--query-compute-apps=} ;;
        --format=*) fmt=${arg#--format=} ;;
        *) echo "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help." >&2; exit 2 ;;
    esac
done
case ",$fmt," in *,noheader,*) header= ;; *) header=1 ;; esac
case ",$fmt," in *,nounits,*) nounits=1 ;; *) nounits= ;; esac
[ -n "$apps" ] && { [ -n "$header" ] && echo "$apps" | sed 's/,/, /g'; exit 0; }
[ -n "$query" ] && [ -n "$fmt" ] || { echo "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help." >&2; exit 2; }
[ -n "$header" ] && echo "$query" | sed 's/,/, /g'
i=0
while [ $i -lt $gpus ]; do
    line= sep=
    for f in $(echo "$query" | tr ',' ' '); do
        v=$(field "$f" $i "$nounits") || { echo "Field \"$f\" is not a valid field to query." >&2; exit 2; }
        line="$line$sep$v"; sep=", "
    done
    echo "$line"
    i=$((i + 1))
done
SMI
    chmod 755 /usr/bin/nvidia-smi
fi
