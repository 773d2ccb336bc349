#!/usr/bin/python3
"""Read-only probe of the local NVMe drives for the nvme_raid role; prints one JSON object.

It classifies every candidate drive and decides what the role must do, so the data-safety rule
lives in one place that can be tested:
  blank    no partition table, filesystem or md superblock: safe to use
  member   a member of this role's assembled array /dev/md/<name>
  ours     carries this role's md superblock (same array name) but is not assembled
  foreign  any other signature: never touched unless --force
  in_use   mounted, swap, or held by another device (LVM, dm, another array): never touched
  root     holds the root, /boot or swap filesystems: never touched
Decision ("action"): none | assemble | create | fail (with "problems", one line per device).
It changes nothing on the host: it only reads sysfs, /proc and the output of wipefs/mdadm/blkid.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys


def run(cmd: list[str]) -> tuple[int, str]:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          universal_newlines=True, check=False)
    return proc.returncode, proc.stdout


def sysblock(name: str) -> str:
    return os.path.realpath(os.path.join("/sys/class/block", name))


def read(path: str, default: str = "") -> str:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return default


def is_partition(name: str) -> bool:
    return os.path.exists(os.path.join(sysblock(name), "partition"))


def parent_disks(name: str) -> set[str]:
    """Whole disks underneath a block device (partition -> disk, dm/md -> their slaves' disks)."""
    if is_partition(name):
        return {os.path.basename(os.path.dirname(sysblock(name)))}
    slaves = os.listdir(os.path.join(sysblock(name), "slaves")) if os.path.isdir(
        os.path.join(sysblock(name), "slaves")) else []
    if not slaves:
        return {name}
    disks: set[str] = set()
    for slave in slaves:
        disks |= parent_disks(slave)
    return disks


def kernel_name(path: str) -> str | None:
    real = os.path.realpath(path)
    if not real.startswith("/dev/"):
        return None
    name = os.path.basename(real)
    return name if os.path.exists(os.path.join("/sys/class/block", name)) else None


def system_disks() -> set[str]:
    """Disks under /, /boot, /boot/efi, /usr, /var and active swap: never candidates."""
    disks: set[str] = set()
    for line in read("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        source = right.split()[1] if len(right.split()) > 1 else ""
        if len(fields) > 4 and fields[4] in ("/", "/boot", "/boot/efi", "/usr", "/var") \
                and source.startswith("/dev/"):
            name = kernel_name(source)
            if name:
                disks |= parent_disks(name)
    for line in read("/proc/swaps").splitlines()[1:]:
        name = kernel_name(line.split()[0])
        if name:
            disks |= parent_disks(name)
    return disks


def mounted_devices() -> set[str]:
    names: set[str] = set()
    for line in read("/proc/self/mountinfo").splitlines():
        right = line.partition(" - ")[2].split()
        if len(right) > 1 and right[1].startswith("/dev/"):
            name = kernel_name(right[1])
            if name:
                names.add(name)
    return names


def children(name: str) -> list[str]:
    base = sysblock(name)
    return sorted(entry for entry in os.listdir(base)
                  if entry.startswith(name) and os.path.exists(os.path.join(base, entry, "partition")))


def holders(name: str) -> list[str]:
    path = os.path.join(sysblock(name), "holders")
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def by_id(name: str) -> str:
    """The stable /dev/disk/by-id name (model_serial form), else the kernel path."""
    links = sorted(glob.glob("/dev/disk/by-id/*"))
    matches = [link for link in links if os.path.realpath(link) == "/dev/" + name]
    preferred = [link for link in matches if "eui." not in link and "nvme-nvme." not in link]
    # the shortest name is the plain model_serial link (newer udev adds _<nsid> variants)
    return min(preferred or matches or ["/dev/" + name], key=len)


def signatures(path: str) -> list[str]:
    code, out = run(["wipefs", "--json", path])
    if code != 0:
        # unreadable: treat as not blank, the safe answer
        return ["unreadable (wipefs exit %d)" % code]
    try:
        return [entry.get("type", "?") for entry in json.loads(out or "{}").get("signatures", [])]
    except ValueError:
        return ["unparseable wipefs output"]


def export(cmd: list[str]) -> dict[str, str]:
    code, out = run(cmd)
    if code != 0:
        return {}
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def md_name_matches(md_name: str, name: str) -> bool:
    # mdadm stores "<homehost>:<name>" unless created with a homehost of "any"
    return md_name == name or md_name.endswith(":" + name)


def our_array(name: str) -> dict | None:
    path = "/dev/md/" + name
    kname = kernel_name(path)
    if not kname or not os.path.isdir(os.path.join(sysblock(kname), "md")):
        return None
    md = os.path.join(sysblock(kname), "md")
    members = sorted(os.path.basename(os.path.realpath(os.path.join(md, entry, "block")))
                     for entry in os.listdir(md) if entry.startswith("dev-"))
    detail = export(["mdadm", "--detail", "--export", path])
    fs = export(["blkid", "-p", "-o", "export", path])
    return {
        "path": path, "kernel": "/dev/" + kname, "level": read(os.path.join(md, "level")),
        "state": read(os.path.join(md, "array_state")), "members": ["/dev/" + m for m in members],
        "uuid": detail.get("MD_UUID", ""), "chunk": read(os.path.join(md, "chunk_size")),
        "size_bytes": int(read(os.path.join(sysblock(kname), "size"), "0")) * 512,
        "fs_type": fs.get("TYPE", ""), "fs_uuid": fs.get("UUID", ""),
    }


def resolve_sources(device_glob: str, candidates: list[str]) -> list[str]:
    paths = sorted(glob.glob(device_glob)) if device_glob else candidates
    names: list[str] = []
    for path in paths:
        name = kernel_name(path)
        if name and not is_partition(name) and name not in names:
            names.append(name)
    return names


def classify(name: str, array: dict | None, sysdisks: set[str], mounted: set[str], role_name: str) -> dict:
    path = "/dev/" + name
    info = {
        "name": name, "path": path, "by_id": by_id(name),
        "size_bytes": int(read(os.path.join(sysblock(name), "size"), "0")) * 512,
        "model": read(os.path.join(sysblock(name), "device", "model")),
        "serial": read(os.path.join(sysblock(name), "device", "serial")),
        "state": "blank", "reason": "",
    }
    array_kernel = os.path.basename(array["kernel"]) if array else None
    busy = [part for part in [name] + children(name) if part in mounted]
    held = [holder for holder in holders(name) if holder != array_kernel]
    if name in sysdisks:
        info.update(state="root", reason="holds the root/boot/swap filesystem")
    elif busy:
        info.update(state="in_use", reason="mounted (%s)" % ", ".join("/dev/" + b for b in busy))
    elif held:
        info.update(state="in_use", reason="held by %s" % ", ".join("/dev/" + h for h in held))
    elif array and path in array["members"]:
        info.update(state="member", reason="member of " + array["path"])
    elif children(name):
        info.update(state="foreign", reason="has a partition table with partitions %s"
                    % ", ".join(children(name)))
    else:
        sigs = signatures(path)
        if sigs == ["linux_raid_member"]:
            exam = export(["mdadm", "--examine", "--export", path])
            info["md_uuid"] = exam.get("MD_UUID", "")
            info["md_devices"] = int(exam.get("MD_DEVICES", "0") or 0)
            if md_name_matches(exam.get("MD_NAME", ""), role_name):
                info.update(state="ours", reason="md superblock of array %s (not assembled)" % role_name)
            else:
                info.update(state="foreign", reason="md superblock of another array (%s)"
                            % exam.get("MD_NAME", "unknown name"))
        elif sigs:
            info.update(state="foreign", reason="carries %s" % ", ".join(sigs))
    return info


def decide(devices: list[dict], array: dict | None, discovered: bool, expected: int, force: bool) -> dict:
    problems: list[str] = []
    excluded = []
    usable = []
    for dev in devices:
        if dev["state"] in ("root", "in_use"):
            if discovered:  # discovery skips the system and busy disks; a glob must not match them
                excluded.append(dev)
                continue
            problems.append("%s (%s) %s: refusing even with nvme_raid_force"
                            % (dev["path"], dev["by_id"], dev["reason"]))
        usable.append(dev)
    if problems:
        return {"action": "fail", "problems": problems, "devices": usable, "excluded": excluded}
    if not usable:
        return {"action": "fail", "devices": usable, "excluded": excluded,
                "problems": ["no local NVMe drives found (glob or facts matched nothing usable)"]}
    if expected and len(usable) != expected:
        return {"action": "fail", "devices": usable, "excluded": excluded, "problems": [
            "found %d local NVMe drives (%s), expected %d (nvme_raid_expected_devices)"
            % (len(usable), ", ".join(d["by_id"] for d in usable), expected)]}
    states = {dev["state"] for dev in usable}
    wanted = sorted(dev["path"] for dev in usable)
    result = {"devices": usable, "excluded": excluded, "problems": [], "wipe": []}
    if array and states == {"member"} and sorted(array["members"]) == wanted:
        result["action"] = "none"
        return result
    if not array and states == {"ours"} and len({d.get("md_uuid") for d in usable}) == 1 \
            and usable[0].get("md_devices") == len(usable):
        result["action"] = "assemble"
        return result
    if states == {"blank"} and not array:
        result["action"] = "create"
        return result
    # Anything else would destroy data: foreign signatures, a half-wiped set of our members, or
    # an array whose members differ from the drives found.
    for dev in usable:
        if dev["state"] != "blank":
            problems.append("%s (%s) %s" % (dev["path"], dev["by_id"], dev["reason"]))
    if array and sorted(array["members"]) != wanted:
        problems.append("%s exists with members %s, not the drives found (%s)"
                        % (array["path"], ", ".join(array["members"]), ", ".join(wanted)))
    if force:
        result.update(action="create", problems=problems,
                      wipe=[dev["path"] for dev in usable if dev["state"] != "blank"])
        return result
    result.update(action="fail", problems=problems)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--glob", default="")
    parser.add_argument("--candidate", action="append", default=[])
    parser.add_argument("--expected", type=int, default=0)
    parser.add_argument("--force", choices=["true", "false"], default="false")
    args = parser.parse_args()
    # settle udev so by-id links and md assembly reflect the drives present now
    run(["udevadm", "settle", "--timeout=30"])
    array = our_array(args.name)
    sysdisks = system_disks()
    mounted = mounted_devices()
    names = resolve_sources(args.glob, args.candidate)
    devices = [classify(name, array, sysdisks, mounted, args.name) for name in names]
    result = decide(devices, array, not args.glob, args.expected, args.force == "true")
    result["array"] = array
    result["system_disks"] = sorted(sysdisks)
    json.dump(result, sys.stdout, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
