"""The nvme_raid role on a real (emulated) Debian guest with four NVMe drives.

Boots the cached bookworm image (tests/vm/build_image.sh, built by .ci/setup.d/20-vm-image.sh)
under qemu TCG and runs the role through the same site.yml / inventory shape that
`gpuprov generate --cloud onprem` writes, limited by `--tags storage`. Steps share one guest and
run in file order; each prints its time. Skipped, loudly, only where qemu or the image is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import yaml

from vm.harness import REPO, TASK_TIMER_ENV, Guest, task_times, recap, why_not_runnable

pytestmark = [pytest.mark.vm, pytest.mark.slow]

NAME = "scratch"
MOUNT = "/scratch"
DRIVES = 4
DRIVE_BYTES = 2**30
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
TIMINGS: dict[str, float] = {}
GATE: dict = {}  # the OS/GPU gate pointed at the guest, set once it boots

_reason = why_not_runnable()
if _reason:
    warnings.warn(f"VM TESTS SKIPPED: {_reason}", stacklevel=1)
    pytest.skip(f"VM TESTS SKIPPED (nvme_raid role not proven on a guest): {_reason}",
                allow_module_level=True)


def _sample_plan():
    """The onprem sample plan, with storage matching the guest (4 x 1 GiB drives)."""
    from plan_fixtures import sample_plan

    plan = sample_plan("onprem", nodes=1)
    storage = plan.storage.model_copy(update={"devices": DRIVES, "expected_bytes": DRIVES * DRIVE_BYTES,
                                              "mount_point": MOUNT, "raid_name": NAME})
    return plan.model_copy(update={"storage": storage})


def _write_bundle(root: Path, guest: Guest) -> tuple[Path, str]:
    """ansible/ as `gpuprov generate` writes it (render_ansible when it exists), inventory -> guest.

    Returns the bundle's ansible dir and a note saying which glue was used."""
    bundle = root / "ansible"
    plan = _sample_plan()
    host = plan.hosts[0].name
    try:
        from gpuprov.render.ansible import render_ansible
    except ImportError:
        render_ansible = None
    if render_ansible is not None:
        note = "rendered by gpuprov.render.ansible.render_ansible(sample_plan('onprem'))"
        for rel, text in render_ansible(plan).items():
            path = bundle / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    else:
        # Same shape until render_ansible lands: one play on gpu_nodes, the role tagged storage.
        note = "minimal stand-in glue (gpuprov.render.ansible not there yet)"
        (bundle / "group_vars").mkdir(parents=True)
        (bundle / "site.yml").write_text(yaml.safe_dump([{
            "name": "Local NVMe scratch", "hosts": "gpu_nodes", "become": True,
            "roles": [{"role": "nvme_raid", "tags": ["storage"]}]}], sort_keys=False))
        (bundle / "group_vars" / "all.yml").write_text(yaml.safe_dump({
            "nvme_raid_name": plan.storage.raid_name, "nvme_raid_mount_point": plan.storage.mount_point,
            "nvme_raid_device_glob": plan.storage.device_glob or "",
            "nvme_raid_expected_devices": plan.storage.devices, "nvme_raid_force": False,
            "nvme_raid_update_initramfs": True}))
    rendered = yaml.safe_load((bundle / "group_vars" / "all.yml").read_text())
    # the plan's storage decisions reach the role through the glue
    assert rendered["nvme_raid_expected_devices"] == DRIVES
    assert rendered["nvme_raid_mount_point"] == MOUNT and rendered["nvme_raid_name"] == NAME
    if not (bundle / "roles").exists():
        shutil.copytree(REPO / "ansible" / "roles", bundle / "roles")
    # The guest is the plan's one host; connection details replace the plan's address.
    (bundle / "inventory.yml").write_text(yaml.safe_dump(
        {"all": {"children": {"gpu_nodes": {"hosts": {host: guest.inventory_host_vars()}}}}}))
    return bundle, note


@pytest.fixture(scope="module")
def vm(request):
    # Not tmp_path_factory: other users' pytest sessions prune /tmp/pytest-of-<user> under us.
    work = Path(tempfile.mkdtemp(prefix="gpuprov-vm-"))
    request.addfinalizer(lambda: shutil.rmtree(work, ignore_errors=True))
    guest = Guest(work / "guest", drives=DRIVES, drive_bytes=DRIVE_BYTES)
    bundle, note = _write_bundle(work, guest)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    began = time.monotonic()
    try:
        TIMINGS["boot"] = guest.start()
        # site.yml's OS/GPU gate runs whatever the tags: pointed at the guest (Debian, no GPU)
        GATE.update(gpu_preflight_supported_os=["debian-" + guest.ssh("cat /etc/debian_version").stdout.strip()],
                    gpu_preflight_require_gpu=False)
        yield guest, bundle, note
    finally:
        guest.poweroff()
        guest.kill()
        TIMINGS["module total"] = time.monotonic() - began
        lines = [f"nvme_raid VM test timings ({note}):"] + [
            f"  {step:<34} {seconds:7.1f} s" for step, seconds in TIMINGS.items()]
        (work.parent / "gpuprov-vm-timings.txt").write_text("\n".join(lines) + "\n")
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        if reporter and capture:
            with capture.global_and_fixture_disabled():
                reporter.write_line("")
                for line in lines:
                    reporter.write_line(line)
        else:
            print("\n".join(lines))


def play(bundle: Path, *extra: str, tags: str = "storage", check: bool = False,
         extra_vars: dict | None = None, step: str) -> subprocess.CompletedProcess:
    # The guest is emulated: update-initramfs takes minutes there (production keeps the default).
    variables = {"nvme_raid_update_initramfs": False, **GATE, **(extra_vars or {})}
    cmd = [str(ANSIBLE_PLAYBOOK), "-i", "inventory.yml", "site.yml", "--tags", tags,
           "-e", json.dumps(variables), *extra]
    if check:
        cmd.append("--check")
    # gathering=smart: facts once per run, not once per play (every play gathers even when its
    # tags are not selected, and fact gathering costs tens of seconds under emulation)
    env = dict(os.environ, ANSIBLE_HOST_KEY_CHECKING="False", ANSIBLE_PIPELINING="True",
               ANSIBLE_NOCOLOR="1", ANSIBLE_RETRY_FILES_ENABLED="False", ANSIBLE_FORCE_COLOR="0",
               ANSIBLE_GATHERING="smart", **TASK_TIMER_ENV)
    began = time.monotonic()
    result = subprocess.run(cmd, cwd=bundle, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env,
                            timeout=600)
    TIMINGS[step] = time.monotonic() - began
    result.stdout += result.stderr
    print(f"\n[{step}: {TIMINGS[step]:.0f} s] {task_times(result.stdout)}")
    return result


def counters(result: subprocess.CompletedProcess) -> dict[str, int]:
    found = recap(result.stdout)
    assert len(found) == 1, f"no PLAY RECAP in:\n{result.stdout[-3000:]}"
    return next(iter(found.values()))


def array_state(guest: Guest) -> dict:
    """What the guest says, independently of the role: md detail, mount, size."""
    out = guest.ssh(
        f"mdadm --detail --export /dev/md/{NAME}; echo ---; "
        f"mdadm --detail /dev/md/{NAME}; echo ---; "
        f"findmnt --json --bytes --output SOURCE,FSTYPE,SIZE,UUID --mountpoint {MOUNT}; echo ---; "
        f"xfs_info {MOUNT}").stdout
    export, detail, mount, xfs = out.split("---\n")
    state = dict(line.split("=", 1) for line in export.splitlines() if "=" in line)
    state["detail"] = detail
    state["mount"] = json.loads(mount)["filesystems"][0]
    state["xfs_info"] = xfs
    return state


def assert_built(guest: Guest, fs_uuid: str | None = None) -> dict:
    state = array_state(guest)
    assert "MD_LEVEL" in state, (f"/dev/md/{NAME} missing: "
                                 + guest.ssh("ls -l /dev/md/; cat /proc/mdstat", check=False).stdout)
    assert state["MD_LEVEL"] == "raid0", state["detail"]
    # host-independent superblock name: assembled as /dev/md/<name> anywhere
    assert state["MD_NAME"] in (NAME, f"any:{NAME}"), state["MD_NAME"]
    assert state["MD_DEVICES"] == str(DRIVES), state["detail"]
    members = {v for k, v in state.items() if k.startswith("MD_DEVICE_") and k.endswith("_DEV")}
    assert len(members) == DRIVES, state["detail"]
    assert "Raid Level : raid0" in state["detail"] and "Raid Devices : 4" in state["detail"]
    # every emulated drive is a member, whatever order the kernel named them in
    byid = guest.ssh(" ".join(f"readlink -f {guest.by_id(i)};" for i in range(DRIVES))).stdout.split()
    assert set(byid) == members
    mount = state["mount"]
    assert mount["fstype"] == "xfs"
    # 4 x 1 GiB RAID0 minus md metadata and XFS log: within 10% of the plan's expected bytes
    expected = _sample_plan().storage.expected_bytes
    assert 0.9 * expected <= mount["size"] <= expected, mount
    if fs_uuid:
        assert mount["uuid"] == fs_uuid
    # stripe alignment: sunit = 512 KiB chunk, swidth = 4 chunks (xfs_info reports 4 KiB blocks)
    assert re.search(r"sunit=128\s+swidth=512 blks", state["xfs_info"]), state["xfs_info"]
    return state


def test_0_check_mode_changes_nothing(vm):
    guest, bundle, _ = vm
    result = play(bundle, check=True, step="0 check mode on blank drives")
    assert result.returncode == 0, result.stdout[-4000:]
    assert "would build /dev/md/scratch" in result.stdout
    assert guest.ssh(f"wipefs {' '.join(guest.by_id(i) for i in range(DRIVES))}; test ! -e /dev/md/{NAME}"
                     ).stdout.strip() == ""


def test_1_fresh_drives_build_raid0(vm):
    guest, bundle, note = vm
    result = play(bundle, step="1 build on fresh drives")
    assert result.returncode == 0, result.stdout[-6000:]
    assert counters(result)["changed"] > 0
    assert "nvme_raid_update_initramfs is false" in result.stdout  # never skipped silently
    state = assert_built(guest)
    conf = guest.ssh("grep ^ARRAY /etc/mdadm/mdadm.conf").stdout
    assert f"ARRAY /dev/md/{NAME} metadata=1.2 UUID={state['MD_UUID']}" in conf
    units = guest.ssh(f"systemctl is-enabled scratch.mount nvme-raid-{NAME}-rebuild.service").stdout.split()
    assert units == ["enabled", "enabled"]


def test_2_second_run_changes_nothing(vm):
    guest, bundle, _ = vm
    before = array_state(guest)
    result = play(bundle, step="2 second run (changed=0)")
    assert result.returncode == 0, result.stdout[-4000:]
    assert counters(result)["changed"] == 0, result.stdout[-6000:]
    assert array_state(guest)["mount"]["uuid"] == before["mount"]["uuid"]


def test_3_reboot_assembles_and_mounts(vm):
    guest, _, _ = vm
    uuid = array_state(guest)["mount"]["uuid"]
    guest.ssh(f"echo survives-reboot > {MOUNT}/marker")
    TIMINGS["3 reboot"] = guest.reboot()
    assert_built(guest, fs_uuid=uuid)
    assert guest.ssh(f"cat {MOUNT}/marker").stdout.strip() == "survives-reboot"
    # a normal boot must not have rebuilt anything: the unit's condition skipped it
    log = guest.ssh(f"journalctl -b -u nvme-raid-{NAME}-rebuild.service --no-pager").stdout
    assert "recreating" not in log


def test_4_wiped_drives_rebuilt_at_boot(vm):
    guest, _, _ = vm
    uuid = array_state(guest)["mount"]["uuid"]
    TIMINGS["4 poweroff"] = guest.poweroff()
    guest.wipe_drives()  # what a cloud does to instance storage across stop/start
    # the rebuild runs before sshd: give the boot the unit's own start timeout (wait + 600 s)
    TIMINGS["4 boot on wiped drives"] = guest.start(timeout=720)
    log = guest.ssh(f"journalctl -b -u nvme-raid-{NAME}-rebuild.service --no-pager").stdout
    assert "recreating /dev/md/scratch" in log, log
    # same filesystem UUID (the mount unit is by UUID), empty filesystem
    assert_built(guest, fs_uuid=uuid)
    assert guest.ssh(f"ls -A {MOUNT}").stdout.strip() == ""
    assert guest.ssh(f"stat -c %a {MOUNT}").stdout.strip() == "1777"


def test_5_foreign_filesystem_is_never_destroyed(vm):
    guest, bundle, _ = vm
    victim = guest.by_id(1)
    # The old array's XFS survives the wipefs below (it sits in md's data area, not at the
    # members' offset 0): a new array must get a new filesystem, never that stale one.
    stale_uuid = array_state(guest)["mount"]["uuid"]
    guest.ssh(f"touch {MOUNT}/stale-marker && sync")
    guest.ssh(f"systemctl stop scratch.mount && mdadm --stop /dev/md/{NAME} && "
              f"wipefs --all --quiet {' '.join(guest.by_id(i) for i in range(DRIVES))} && "
              f"mkfs.ext4 -q -F {victim} && mkdir -p /mnt/v && mount {victim} /mnt/v && "
              f"head -c 1048576 /dev/urandom > /mnt/v/precious && sync && umount /mnt/v")
    checksum = guest.ssh(f"mount -o ro {victim} /mnt/v && sha256sum /mnt/v/precious; umount /mnt/v").stdout
    result = play(bundle, step="5 refuse on foreign ext4")
    assert result.returncode != 0
    assert counters(result)["failed"] == 1
    assert "refusing to build /dev/md/scratch" in result.stdout
    assert "NVME0002" in result.stdout and "ext4" in result.stdout, result.stdout[-3000:]
    assert guest.ssh(f"mount -o ro {victim} /mnt/v && sha256sum /mnt/v/precious; umount /mnt/v"
                     ).stdout == checksum
    assert guest.ssh(f"test -e /dev/md/{NAME}", check=False).returncode != 0

    result = play(bundle, extra_vars={"nvme_raid_force": True}, step="5 nvme_raid_force: true")
    assert result.returncode == 0, result.stdout[-6000:]
    assert "WARNING nvme_raid_force: wiping" in result.stdout
    assert assert_built(guest)["mount"]["uuid"] != stale_uuid
    assert guest.ssh(f"ls -A {MOUNT}").stdout.strip() == ""
    assert guest.ssh(f"blkid -p -o value -s TYPE {victim}").stdout.strip() == "linux_raid_member"


def test_6_gpu_roles_fail_early_without_gpu(vm):
    guest, bundle, note = vm
    site = (bundle / "site.yml").read_text()
    if "tags: [gpu]" not in site or not (bundle / "roles" / "gpu_preflight").is_dir():
        pytest.skip(f"no GPU roles in the glue yet ({note})")
    # Let the OS check pass (the guest is Debian) so the GPU check itself is what stops the play.
    result = play(bundle, tags="gpu", extra_vars={"gpu_preflight_require_gpu": True},
                  step="6 GPU roles on a GPU-less guest")
    assert result.returncode != 0
    assert re.search(r"no nvidia gpu", result.stdout, re.I), result.stdout[-3000:]
    stats = counters(result)
    assert stats["failed"] == 1 and stats["changed"] == 0, stats
    assert guest.ssh("ls /etc/apt/sources.list.d/ | grep -ci cuda", check=False).stdout.strip() in ("", "0")
