"""Fast checks of the nvme_raid role (the VM test, tests/test_vm_nvme_raid.py, runs it for real):
ansible-lint's production profile, syntax-check, the templates as Ansible renders them (the boot
script must be valid bash), and the probe's data-safety decisions, with real wipefs on files."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest
import yaml

from ansible_helpers import REPO, playbook, private_dir
from production_lint import production_lint, role_files

ROLE = REPO / "ansible" / "roles" / "nvme_raid"
PROBE = ROLE / "files" / "nvme_raid_probe.py"


def _probe():
    spec = importlib.util.spec_from_file_location("nvme_raid_probe", PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dev(name: str, state: str = "blank", reason: str = "", **extra) -> dict:
    return {"name": name, "path": f"/dev/{name}", "by_id": f"/dev/disk/by-id/nvme-X_{name}",
            "state": state, "reason": reason, **extra}


@pytest.mark.slow
def test_ansible_lint_production_profile_is_clean():
    lint = production_lint()  # the suite's one run over every role (tests/production_lint.py)
    files = role_files(ROLE)
    assert files and not [f for f in files if f.resolve() not in lint.examined], lint.output[-4000:]
    assert lint.issues_under(ROLE) == []


def test_defaults_are_the_contract_and_commented():
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    for name in ("nvme_raid_name", "nvme_raid_mount_point", "nvme_raid_device_glob",
                 "nvme_raid_expected_devices", "nvme_raid_force", "nvme_raid_update_initramfs"):
        assert name in defaults
    assert defaults["nvme_raid_force"] is False and defaults["nvme_raid_update_initramfs"] is True
    assert defaults["nvme_raid_mount_point"] == "/scratch" and defaults["nvme_raid_device_glob"] == ""
    lines = (ROLE / "defaults" / "main.yml").read_text().splitlines()
    for index, line in enumerate(lines):
        if line and not line.startswith((" ", "#", "-")) and ":" in line and line != "---":
            assert lines[index - 1].startswith("#"), f"knob without a comment: {line}"
    platforms = yaml.safe_load((ROLE / "meta" / "main.yml").read_text())["galaxy_info"]["platforms"]
    assert {p["name"] for p in platforms} >= {"Ubuntu"}


@pytest.mark.slow
def test_syntax_check_and_templates_render_to_valid_files():
    with private_dir("nvme-tpl") as root:
        out = root / "out"
        out.mkdir()
        variables = {"nvme_raid_name": "scratch", "nvme_raid_mount_point": "/scratch",
                     "nvme_raid_fs_label": "scratch", "nvme_raid_chunk_kib": 512,
                     "nvme_raid_boot_wait_s": 90, "nvme_raid_array_uuid": "a:b:c:d",
                     "nvme_raid_fs_uuid": "0f0f0f0f-1111-2222-3333-444455556666",
                     "nvme_raid_members": ["/dev/disk/by-id/nvme-A_1", "/dev/disk/by-id/nvme-A_2"],
                     "nvme_raid_boot_sources": ["/dev/disk/by-id/nvme-Amazon_EC2_NVMe_Instance_Storage_*"],
                     "nvme_raid_mount_unit": "scratch.mount", "nvme_raid_mount_options": "defaults,nofail",
                     "nvme_raid_mount_mode": "1777"}
        tasks = [{"name": f"Render {src}", "ansible.builtin.template": {
            "src": str(ROLE / "templates" / src), "dest": str(out / src[:-3]), "mode": "0644"}}
            for src in ("nvme-raid-rebuild.sh.j2", "nvme-raid-rebuild.service.j2", "nvme-raid.mount.j2")]
        (root / "render.yml").write_text(yaml.safe_dump([{
            "name": "Render", "hosts": "localhost", "gather_facts": False, "connection": "local",
            "vars": {**variables, "ansible_python_interpreter": sys.executable}, "tasks": tasks}]))
        (root / "site.yml").write_text(yaml.safe_dump([{
            "name": "Storage", "hosts": "all", "become": True,
            "roles": [{"role": "nvme_raid", "tags": ["storage"]}]}]))
        shutil.copytree(ROLE.parent, root / "roles")
        check = playbook(root, "-i", "localhost,", "site.yml", "--syntax-check")
        assert check.returncode == 0, check.stdout + check.stderr
        proc = playbook(root, "-i", "localhost,", "render.yml")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        script = (out / "nvme-raid-rebuild.sh").read_text()
        bash = subprocess.run(["bash", "-n", str(out / "nvme-raid-rebuild.sh")], capture_output=True, text=True)
        assert bash.returncode == 0, bash.stderr
        # the glob stays quoted (expanded by the script, not at assignment), the UUIDs are baked in
        assert "sources=('/dev/disk/by-id/nvme-Amazon_EC2_NVMe_Instance_Storage_*')" in script
        assert "--uuid=\"$array_uuid\"" in script and "0f0f0f0f-1111-2222-3333-444455556666" in script
        mount = (out / "nvme-raid.mount").read_text()
        assert "What=/dev/disk/by-uuid/0f0f0f0f-1111-2222-3333-444455556666" in mount
        assert "Where=/scratch" in mount and "nofail" in mount and "WantedBy=local-fs.target" in mount
        service = (out / "nvme-raid-rebuild.service").read_text()
        assert "ConditionPathExists=!/dev/md/scratch" in service
        assert "DefaultDependencies=no" in service and "Before=scratch.mount" in service


@pytest.mark.skipif(shutil.which("wipefs") is None or shutil.which("mkfs.ext4") is None,
                    reason="wipefs/mkfs.ext4 not installed")
def test_probe_sees_filesystems_and_partition_tables_with_real_wipefs(tmp_path):
    probe = _probe()
    blank = tmp_path / "blank.img"
    blank.write_bytes(b"\0" * (8 << 20))
    assert probe.signatures(str(blank)) == []
    ext4 = tmp_path / "ext4.img"
    ext4.write_bytes(b"\0" * (8 << 20))
    subprocess.run(["mkfs.ext4", "-q", "-F", str(ext4)], check=True)
    assert probe.signatures(str(ext4)) == ["ext4"]
    assert probe.signatures(str(tmp_path / "missing.img"))[0].startswith("unreadable")


def test_blank_drives_are_built():
    decide = _probe().decide
    result = decide([dev("nvme1n1"), dev("nvme2n1")], None, discovered=True, expected=2, force=False)
    assert result["action"] == "create" and not result["problems"]


def test_our_assembled_array_is_left_alone():
    decide = _probe().decide
    array = {"path": "/dev/md/scratch", "members": ["/dev/nvme1n1", "/dev/nvme2n1"]}
    devices = [dev("nvme2n1", "member"), dev("nvme1n1", "member")]
    assert decide(devices, array, discovered=True, expected=0, force=False)["action"] == "none"


def test_our_unassembled_superblocks_are_assembled_not_recreated():
    decide = _probe().decide
    devices = [dev(n, "ours", md_uuid="u1", md_devices=2) for n in ("nvme1n1", "nvme2n1")]
    assert decide(devices, None, discovered=True, expected=2, force=False)["action"] == "assemble"
    # half a set (one drive replaced): never guessed at
    devices[1] = dev("nvme2n1")
    assert decide(devices, None, discovered=True, expected=2, force=False)["action"] == "fail"


def test_foreign_data_fails_naming_the_drive_unless_forced():
    decide = _probe().decide
    devices = [dev("nvme1n1"), dev("nvme2n1", "foreign", "carries ext4")]
    result = decide(devices, None, discovered=False, expected=0, force=False)
    assert result["action"] == "fail"
    assert result["problems"] == ["/dev/nvme2n1 (/dev/disk/by-id/nvme-X_nvme2n1) carries ext4"]
    forced = decide(devices, None, discovered=False, expected=0, force=True)
    assert forced["action"] == "create" and forced["wipe"] == ["/dev/nvme2n1"]


def test_system_and_busy_disks():
    decide = _probe().decide
    devices = [dev("nvme0n1", "root", "holds the root/boot/swap filesystem"), dev("nvme1n1"),
               dev("nvme2n1", "in_use", "mounted (/dev/nvme2n1p1)")]
    # discovery (on-prem, Azure, OCI) quietly leaves the system disk and a mounted disk out
    found = decide(devices, None, discovered=True, expected=0, force=False)
    assert found["action"] == "create" and [d["name"] for d in found["devices"]] == ["nvme1n1"]
    assert {d["name"] for d in found["excluded"]} == {"nvme0n1", "nvme2n1"}
    # a glob that matches them is a mistake: refused even with force
    globbed = decide(devices, None, discovered=False, expected=0, force=True)
    assert globbed["action"] == "fail"
    assert any("nvme0n1" in p and "even with nvme_raid_force" in p for p in globbed["problems"])


def test_wrong_drive_count_fails():
    decide = _probe().decide
    result = decide([dev("nvme1n1")], None, discovered=True, expected=8, force=True)
    assert result["action"] == "fail" and "expected 8" in result["problems"][0]
    assert decide([], None, discovered=True, expected=0, force=True)["action"] == "fail"


def test_array_with_other_members_is_not_rebuilt_silently():
    decide = _probe().decide
    array = {"path": "/dev/md/scratch", "members": ["/dev/nvme1n1", "/dev/nvme2n1"]}
    devices = [dev("nvme1n1", "member"), dev("nvme2n1", "member"), dev("nvme3n1")]
    result = decide(devices, array, discovered=True, expected=0, force=False)
    assert result["action"] == "fail" and "exists with members" in result["problems"][-1]


def test_boot_rebuild_gives_up_after_wait_seconds_not_rounds(tmp_path):
    """nvme_raid_boot_wait_s is seconds: with drives that never appear and a slow `udevadm settle`
    (early boot under load), the unit gives up after about that long, not after that many rounds
    of settle + sleep (90 rounds of a 5 s settle held a node's boot, and its sshd, for 9 minutes)."""
    import shlex
    import time

    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    env.filters["quote"] = lambda value: shlex.quote(str(value))
    text = env.from_string((ROLE / "templates" / "nvme-raid-rebuild.sh.j2").read_text()).render(
        ansible_managed="test", nvme_raid_name="scratch-test-never", nvme_raid_array_uuid="a:b:c:d",
        nvme_raid_fs_uuid="0f0f0f0f-1111-2222-3333-444455556666", nvme_raid_fs_label="scratch",
        nvme_raid_chunk_kib=512, nvme_raid_members=["/dev/disk/by-id/nvme-A_1"] * 2, nvme_raid_boot_wait_s=3,
        nvme_raid_mount_mode="1777", nvme_raid_boot_sources=[str(tmp_path / "no-such-drive-*")])
    script = tmp_path / "rebuild.sh"
    script.write_text(text)
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "udevadm").write_text("#!/bin/sh\nsleep 3\n")  # a settle that takes its time
    (stubs / "udevadm").chmod(0o755)
    began = time.monotonic()
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                         env={"PATH": f"{stubs}:/usr/bin:/bin"})
    took = time.monotonic() - began
    assert run.returncode == 1 and "found 0 drives" in run.stderr, run.stderr
    assert took < 9, f"gave up after {took:.0f} s with nvme_raid_boot_wait_s=3"  # 3 rounds took 12 s
