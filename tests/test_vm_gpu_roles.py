"""The GPU roles' package logic on the qemu guest, against signed stand-in apt repositories.

One boot of the cached Debian image (tests/vm/harness.py); the stand-in repositories
(tests/vm/standin_repo.py, packages in tests/vm/standin_packages.yaml: real names, versions,
Depends/Conflicts) are built here, signed with throwaway keys (armored and binary), copied into
the guest and served as file: repositories. The OS gate is pointed at the guest (debian-12, no
GPU). The roles run in site.yml's order: node_baseline, infiniband (DOCA path), nvidia_driver,
gcp_rdma (gIB), nccl, gds (compatibility mode). Three runs in one boot:

1. an image that already has a newer driver (580, a stand-in module `modinfo` reads) and holds an
   older NCCL: the driver and NCCL are kept, fabric manager follows the 580 branch, DOCA, gIB,
   DCGM and GDS install from their repositories with pins and holds;
2. a bare image: the 570 -server driver installs from the Ubuntu repository although the CUDA
   repository carries the same names at higher versions (the pin), fabric manager matches the
   driver version exactly, and the reboot handler reboots the guest;
3. the same again: changed=0;
4. the Azure ubuntu-hpc 22.04 profile (catalog images.yaml): CUDA-repository nvidia-open 580 with
   the repository moved past the image's build, DCGM cuda13, held NCCL, an MPI nccl-tests build:
   the package list gains only the unsuffixed fabric manager and NSCQ at the driver's build;
5. the same again: changed=0.

A stand-in cannot prove that a real driver loads; it proves what the roles decide.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import yaml

from vm.harness import TASK_TIMER_ENV, Guest, task_times, recap, why_not_runnable

pytestmark = [pytest.mark.vm, pytest.mark.slow]

ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
MOUNT = "/srv/gpuprov-standin"
VERSION_FILE = "/var/lib/gpuprov-test/nvidia-version"
TIMINGS: dict[str, float] = {}

_reason = why_not_runnable() or next((f"{tool} is not installed" for tool in ("gpg", "dpkg-deb", "dpkg-scanpackages", "gcc")
                                      if shutil.which(tool) is None), None) \
    or (None if list(Path("/usr/lib/python3/dist-packages").glob("apt_pkg*.so")) else "python3-apt is not installed")
if _reason:
    warnings.warn(f"VM TESTS SKIPPED: {_reason}", stacklevel=1)
    pytest.skip(f"VM TESTS SKIPPED (GPU roles not proven on a guest): {_reason}", allow_module_level=True)


def _upload(guest: Guest, local: Path, remote: str) -> None:
    pack = subprocess.Popen(["tar", "-C", str(local), "-cz", "."], stdout=subprocess.PIPE)
    unpack = subprocess.run(["ssh", *guest.ssh_options(), "-p", str(guest.port), "root@127.0.0.1",
                             f"mkdir -p {remote} && tar -C {remote} -xz"], stdin=pack.stdout, capture_output=True,
                            text=True, timeout=300)
    pack.wait()
    assert unpack.returncode == 0 and pack.returncode == 0, unpack.stderr


def _python3_apt(work: Path) -> Path:
    files = subprocess.run(["dpkg", "-L", "python3-apt", "python-apt-common"], capture_output=True, text=True,
                           check=True).stdout.split()
    root = work / "python3-apt"
    for name in files:
        src = Path(name)
        if src.is_file():
            dest = root / name.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)
    return root


def _variables(built: dict, os_id: str) -> dict:
    keys = {name: info["key_file"] for name, info in built.items()}
    return {
        "gpu_preflight_supported_os": [os_id], "gpu_preflight_require_gpu": False,
        "nvidia_driver_branch": "570", "nvidia_driver_open_kernel_modules": True,
        "nvidia_driver_fabric_manager": True, "nvidia_driver_gpu_architecture": "hopper",
        "nvidia_driver_cuda_repo_url": built["cuda"]["dir"], "nvidia_driver_loaded_version_file": VERSION_FILE,
        "nvidia_driver_reboot_allowed": True, "nvidia_driver_reboot_timeout": 900,
        # update-initramfs takes ten minutes under emulation (production keeps the default)
        "nvidia_driver_update_initramfs": False, "nvidia_driver_dcgm_version": "1:4.5.2-1",
        "infiniband_stack": "doca", "infiniband_doca_version": "2.9.1",
        "infiniband_doca_repo_url": f"file:{built['doca']['dir']}/", "infiniband_doca_key_url": f"file://{keys['doca']}",
        "infiniband_subnet_manager": "none", "infiniband_peermem": False, "infiniband_port_delay": 1,
        "gcp_rdma_mode": "roce", "gcp_rdma_mtu": 0, "gcp_rdma_gib_version": "1.1.0",
        "gcp_rdma_apt_keys": [{"url": f"file://{keys['google-transport']}", "keyring": "/etc/apt/keyrings/google-cloud"},
                              {"url": f"file://{keys['google-gib']}", "keyring": "/etc/apt/keyrings/google-artifact-registry"}],
        "gcp_rdma_ar_transport_repo": f"file:{built['google-transport']['dir']} ./",
        "gcp_rdma_gib_repo": f"file:{built['google-gib']['dir']} ./",
        "nccl_version": "2.26.2-1+cuda12.8", "nccl_cuda_version": "12.8", "nccl_tests_build": False,
        "nccl_env": {"NCCL_DEBUG": "WARN"},
        "gds_mode": "compat", "gds_cuda_version": "12.8",
    }


def _write_bundle(root: Path, guest: Guest, built: dict, os_id: str) -> Path:
    bundle = root / "ansible"
    shutil.copytree(Path(__file__).resolve().parents[1] / "ansible" / "roles", bundle / "roles")
    (bundle / "inventory.yml").write_text(yaml.safe_dump(
        {"all": {"children": {"gpu_nodes": {"hosts": {"gpu-vm": guest.inventory_host_vars()}}}}}))
    roles = [{"role": "gpu_preflight"}, {"role": "node_baseline"},
             {"role": "infiniband", "vars": {"infiniband_phase": "stack"}}, {"role": "nvidia_driver"},
             {"role": "infiniband", "vars": {"infiniband_phase": "peermem"}}, {"role": "gcp_rdma"},
             {"role": "nccl"}, {"role": "gds"}]
    (bundle / "site.yml").write_text(yaml.safe_dump([{"name": "GPU roles on the guest", "hosts": "gpu_nodes",
                                                      "become": True, "roles": roles}], sort_keys=False))
    (bundle / "vars.json").write_text(json.dumps(_variables(built, os_id)))
    return bundle


def play(bundle: Path, step: str, extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, ANSIBLE_HOST_KEY_CHECKING="False", ANSIBLE_PIPELINING="True", ANSIBLE_NOCOLOR="1",
               ANSIBLE_RETRY_FILES_ENABLED="False", ANSIBLE_FORCE_COLOR="0", ANSIBLE_STDOUT_CALLBACK="default",
               ANSIBLE_CALLBACK_RESULT_FORMAT="yaml", **TASK_TIMER_ENV)
    began = time.monotonic()
    more = ["-e", json.dumps(extra)] if extra else []
    result = subprocess.run([str(ANSIBLE_PLAYBOOK), "-i", "inventory.yml", "site.yml", "-e", "@vars.json", *more],
                            cwd=bundle, capture_output=True, text=True, env=env, timeout=2400)
    TIMINGS[step] = time.monotonic() - began
    result.stdout += result.stderr
    print(f"\n[{step}: {TIMINGS[step]:.0f} s] {task_times(result.stdout)}")
    (bundle / f"{step.split()[0]}.log").write_text(result.stdout)
    return result


def counters(result: subprocess.CompletedProcess) -> dict[str, int]:
    found = recap(result.stdout)
    assert len(found) == 1, f"no PLAY RECAP in:\n{result.stdout[-4000:]}"
    return next(iter(found.values()))


def packages(guest: Guest) -> dict[str, tuple[str, str]]:
    """Installed packages: name -> (version, selection) as dpkg records them."""
    out = guest.ssh("dpkg-query -W -f='${Package} ${Version} ${db:Status-Want} ${db:Status-Status}\\n'").stdout
    found = {}
    for line in out.splitlines():
        name, version, want, status = line.split()
        if status == "installed":
            found[name] = (version, want)
    return found


@pytest.fixture(scope="module")
def vm(request):
    work = Path(tempfile.mkdtemp(prefix="gpuprov-vm-gpu-"))
    guest = Guest(work / "guest", drives=0, memory_mb=2048)
    began = time.monotonic()
    try:
        TIMINGS["boot"] = guest.start()
        kernel = guest.ssh("uname -r").stdout.strip()
        kernel_version = guest.ssh(f"dpkg-query -W -f='${{Version}}' linux-image-{kernel}").stdout.strip()
        from vm.standin_repo import build, fake_module

        t0 = time.monotonic()
        built = build(work / "repo", MOUNT, kernel, kernel_version)
        module = fake_module(work, "580.65.06")
        TIMINGS["build stand-in repositories"] = time.monotonic() - t0
        _upload(guest, work / "repo", MOUNT)
        # Ubuntu's images ship python3-apt (Ansible's apt modules need it); the minimal guest
        # gets this machine's copy (same Debian release), files only
        _upload(guest, _python3_apt(work), "/")
        # the image's base archive: the stand-in Ubuntu repository only (the guest is offline)
        guest.ssh(f"rm -f /etc/apt/sources.list /etc/apt/sources.list.d/* && mkdir -p /etc/apt/keyrings && "
                  f"cp {built['ubuntu']['key_file']} /etc/apt/keyrings/standin-ubuntu.asc && "
                  f"echo 'deb [signed-by=/etc/apt/keyrings/standin-ubuntu.asc] file:{built['ubuntu']['dir']} ./' "
                  f">/etc/apt/sources.list.d/standin-ubuntu.list && apt-get update -q")
        guest.ssh(f"mkdir -p /lib/modules/{kernel}/updates/dkms /var/lib/gpuprov-test")
        subprocess.run(["scp", *guest.ssh_options(), "-P", str(guest.port), str(module),
                        f"root@127.0.0.1:/lib/modules/{kernel}/updates/dkms/nvidia.ko"], check=True, capture_output=True)
        # the OS gate pointed at the guest, as Ansible names it (distribution_version is debian_version)
        os_id = "debian-" + guest.ssh("cat /etc/debian_version").stdout.strip()
        bundle = _write_bundle(work, guest, built, os_id)
        yield guest, bundle, built, kernel
    finally:
        guest.poweroff()
        guest.kill()
        TIMINGS["module total"] = time.monotonic() - began
        lines = ["GPU roles VM test timings:"] + [f"  {step:<40} {s:7.1f} s" for step, s in TIMINGS.items()]
        (work.parent / "gpuprov-vm-gpu-timings.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        keep = os.environ.get("GPUPROV_VM_KEEP")
        if keep:
            shutil.copytree(work / "ansible", keep, dirs_exist_ok=True, ignore=shutil.ignore_patterns("roles"))
        shutil.rmtree(work, ignore_errors=True)


def test_1_image_with_newer_driver_and_held_nccl_keeps_both(vm):
    guest, bundle, built, kernel = vm
    cuda = built["cuda"]["dir"]
    # what such an image carries: driver 580 (the module modinfo reads, loaded), and NCCL held
    guest.ssh(f"depmod -a {kernel} && modinfo nvidia | grep -q '^version: *580.65.06' && "
              f"echo 580.65.06 >{VERSION_FILE} && "
              f"dpkg -i {built['ubuntu']['dir']}/nvidia-kernel-common-580-server_580.65.06-0ubuntu0.22.04.1_amd64.deb "
              f"{built['ubuntu']['dir']}/nvidia-compute-utils-580-server_580.65.06-0ubuntu0.22.04.1_amd64.deb "
              f"{cuda}/libnccl2_2.21.5-1+cuda12.4_amd64.deb && apt-mark hold libnccl2")
    result = play(bundle, "1 newer driver image")
    assert result.returncode == 0, result.stdout[-6000:]
    out = result.stdout
    assert "a newer driver is present: keep it" in out
    assert "NCCL is held at 2.21.5-1+cuda12.4: keep it" in out
    have = packages(guest)
    assert "nvidia-headless-570-server-open" not in have  # nothing of the older plan branch
    assert have["libnccl2"] == ("2.21.5-1+cuda12.4", "hold") and "libnccl-dev" not in have
    assert have["nvidia-fabricmanager-580"] == ("580.65.06-0ubuntu0.22.04.1", "hold")  # the running branch
    assert have["doca-ofed"] == ("2.9.1-0.0.1", "hold")  # the planned release, not the newest
    assert have["nccl-gib"] == ("1.1.0", "hold")  # pinned although 1.1.1 is in the repository
    # DCGM by the driver's CUDA major (580 -> 13), pinned, although the plan trains with CUDA 12.8
    assert have["datacenter-gpu-manager-4-cuda13"] == ("1:4.5.2-1", "hold")
    assert "datacenter-gpu-manager-4-cuda12" not in have
    assert have[f"linux-image-{kernel}"][1] == "hold"  # node_baseline holds the running kernel
    assert "libcufile-12-8" in have and "GDS in compat mode" in out
    # keyrings named after the key's form; apt accepted every repository (update ran clean)
    rings = guest.ssh("ls /etc/apt/keyrings").stdout.split()
    assert {"google-cloud.asc", "google-artifact-registry.gpg", "doca.asc"} <= set(rings), rings
    assert guest.ssh("test -f /usr/share/keyrings/cuda-archive-keyring.gpg").returncode == 0
    states = guest.ssh("systemctl is-active nvidia-dcgm nvidia-fabricmanager nvidia-persistenced", check=False).stdout
    assert states.split()[:2] == ["active", "active"], states
    assert 'APT::Periodic::Unattended-Upgrade "0"' in guest.ssh("cat /etc/apt/apt.conf.d/20auto-upgrades").stdout


def test_2_bare_image_gets_the_server_driver_from_one_repository_and_reboots(vm):
    guest, bundle, built, kernel = vm
    # the bare image: no driver module, no fabric manager; "loaded" as it will be after the reboot
    guest.ssh(f"rm -f /lib/modules/{kernel}/updates/dkms/nvidia.ko && depmod -a {kernel} && "
              f"apt-mark unhold nvidia-fabricmanager-580 libnvidia-nscq-580 && "
              f"apt-get purge -y -q nvidia-fabricmanager-580 libnvidia-nscq-580 nvidia-compute-utils-580-server "
              f"nvidia-kernel-common-580-server && "
              f"echo 570.172.08 >{VERSION_FILE}")
    boot_id = guest.ssh("cat /proc/sys/kernel/random/boot_id").stdout.strip()
    result = play(bundle, "2 bare image install")
    assert result.returncode == 0, result.stdout[-6000:]
    assert "install branch 570" in result.stdout
    assert "RUNNING HANDLER [nvidia_driver : Reboot after the NVIDIA driver changed]" in result.stdout
    assert guest.ssh("cat /proc/sys/kernel/random/boot_id").stdout.strip() != boot_id  # it rebooted
    have = packages(guest)
    for name in ("nvidia-headless-570-server-open", "nvidia-utils-570-server", "nvidia-kernel-common-570-server"):
        # Ubuntu's build although the CUDA repository's -1 sorts higher: the pin holds
        assert have[name] == ("570.172.08-0ubuntu0.22.04.1", "hold" if "kernel-common" not in name else have[name][1])
    assert have["nvidia-fabricmanager-570"] == ("570.172.08-0ubuntu0.22.04.1", "hold")  # = the driver
    assert "nvidia-kernel-common-570" not in have  # the other flavour never came in
    assert "Pin: release o=Ubuntu" in guest.ssh("cat /etc/apt/preferences.d/gpuprov-nvidia-570.pref").stdout
    assert have["libnccl2"] == ("2.21.5-1+cuda12.4", "hold")  # still kept


def test_3_second_run_changes_nothing(vm):
    guest, bundle, _, _ = vm
    result = play(bundle, "3 idempotent rerun")
    assert result.returncode == 0, result.stdout[-6000:]
    changed = counters(result)["changed"]
    assert changed == 0, "\n".join(line for line in result.stdout.splitlines() if line.startswith("changed:"))


AZURE = {"nccl_tests_image_dir": "/opt/nccl-tests"}


def test_4_azure_image_keeps_its_stack_and_adds_only_fabric_manager(vm):
    """Profile azure-ubuntu-hpc-2204: CUDA-repository nvidia-open 580 (the repository has moved on to
    580.173.02), DCGM cuda13, NCCL 2.30.4 held, nccl-tests built with MPI in /opt/nccl-tests. The
    fabric manager package is the one thing the plan adds: unsuffixed, the driver's exact build."""
    guest, bundle, built, kernel = vm
    work = Path(tempfile.mkdtemp(prefix="gpuprov-vm-azure-"))
    from vm.standin_repo import fake_module

    module = fake_module(work, "580.126.16")
    subprocess.run(["scp", *guest.ssh_options(), "-P", str(guest.port), str(module),
                    f"root@127.0.0.1:/lib/modules/{kernel}/updates/dkms/nvidia.ko"], check=True, capture_output=True)
    cuda = built["cuda"]["dir"]
    guest.ssh(f"apt-mark unhold nvidia-fabricmanager-570 libnvidia-nscq-570 libnccl2 && "
              f"apt-get purge -y -q nvidia-fabricmanager-570 libnvidia-nscq-570 && "
              f"depmod -a {kernel} && echo 580.126.16 >{VERSION_FILE} && "
              f"dpkg -i {cuda}/nvidia-kernel-common-580_580.126.16-1_amd64.deb {cuda}/nvidia-open_580.126.16-1_amd64.deb "
              f"{cuda}/libnccl2_2.30.4-1+cuda13.0_amd64.deb && apt-mark hold libnccl2 && "
              f"mkdir -p /opt/nccl-tests/build && printf '#!/bin/sh\\nexit 0\\n' >/opt/nccl-tests/build/all_reduce_perf && "
              f"chmod +x /opt/nccl-tests/build/all_reduce_perf")
    before = packages(guest)
    result = play(bundle, "4 azure image", AZURE)
    assert result.returncode == 0, result.stdout[-6000:]
    after = packages(guest)
    added = {name: after[name][0] for name in set(after) - set(before)}
    assert added == {"nvidia-fabricmanager": "580.126.16-1", "libnvidia-nscq": "580.126.16-1"}, added
    assert all(after[name][0] == version for name, (version, _) in before.items()), "a kept package moved"
    assert "keep the image DCGM" in result.stdout and "use the image nccl-tests build" in result.stdout
    assert guest.ssh("test -e /opt/gpuprov/nccl-tests", check=False).returncode != 0  # nothing cloned
    profile = guest.ssh("cat /etc/profile.d/gpuprov-nccl.sh").stdout
    assert "GPUPROV_NCCL_TESTS_BIN=/opt/nccl-tests/build" in profile


def test_5_azure_second_run_changes_nothing(vm):
    guest, bundle, _, _ = vm
    result = play(bundle, "5 azure rerun", AZURE)
    assert result.returncode == 0, result.stdout[-6000:]
    changed = counters(result)["changed"]
    assert changed == 0, "\n".join(line for line in result.stdout.splitlines() if line.startswith("changed:"))
