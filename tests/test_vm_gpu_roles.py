"""The GPU roles on the qemu guest, against signed stand-in apt repositories and image states.

Two boots of the cached Debian image (tests/vm/harness.py), side by side: each TCG guest runs on its
own host core, and every test here runs on whichever guest comes free (the Runner below). The stand-in
repositories (tests/vm/standin_repo.py) hold the packages generated from the image profiles
(tests/vm/standin_profiles.py, from gpuprov/catalog/data/images.yaml: driver, fabric manager,
NSCQ, DCGM and image NCCL builds with their origins, relations and archive states) and what the
profiles cannot say (tests/vm/standin_packages.yaml: DOCA, gIB, GDS, the plan's NCCL), signed with
throwaway keys (armored and binary) and served as file: repositories. The OS gate is pointed at the
guest (debian-12, no GPU). After setup each guest is saved (qemu savevm); each test starts from that
snapshot (loadvm), which is faster than purging to a recorded package baseline and exact.

1. the full role order (node_baseline, infiniband DOCA path, nvidia_driver, gcp_rdma gIB, nccl,
   gds compatibility mode) on an image with a CUDA-repository 580 driver and an older held NCCL:
   both kept, fabric manager follows the driver, DOCA, gIB, DCGM and GDS install pinned;
2. one scenario per image profile (and per possibility of a profile's uncertain facts), running
   the roles whose software the profile describes (nvidia_driver: driver, fabric manager, NSCQ,
   DCGM, persistence; efa where the image has EFA; nccl where it carries NCCL or nccl-tests):
   the play converges, the package list gains exactly what the plan adds, and a second run
   reports changed=0.

GPUPROV_VM picks the jobs: ci (the default, CI's) runs 1. and the image without a driver (the roles'
two driver paths: an image's driver kept, a driver installed and the node rebooted); all runs every
scenario of 2. (about 35 minutes more on a loaded 2-core host).

A stand-in cannot prove that a real driver loads; it proves what the roles decide.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Callable

import pytest
import yaml

from vm.harness import TASK_TIMER_ENV, Guest, task_times, recap, why_not_runnable
from vm.scenarios import BARE_LOADED, SCENARIOS, VERSION_FILE, apply_image, expected_added, scenario_play

pytestmark = [pytest.mark.vm, pytest.mark.slow]

ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
MOUNT = "/srv/gpuprov-standin"
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


def play(bundle: Path, step: str, extra: dict | None = None, playbook: str = "site.yml") -> subprocess.CompletedProcess:
    # a control socket per run: a snapshot revert leaves an earlier run's SSH master pointing at nothing
    control = Path(tempfile.mkdtemp(prefix="cp-", dir=bundle))
    env = dict(os.environ, ANSIBLE_HOST_KEY_CHECKING="False", ANSIBLE_PIPELINING="True", ANSIBLE_NOCOLOR="1",
               ANSIBLE_RETRY_FILES_ENABLED="False", ANSIBLE_FORCE_COLOR="0", ANSIBLE_STDOUT_CALLBACK="default",
               ANSIBLE_CALLBACK_RESULT_FORMAT="yaml", ANSIBLE_SSH_CONTROL_PATH_DIR=str(control), **TASK_TIMER_ENV)
    began = time.monotonic()
    more = ["-e", json.dumps(extra)] if extra else []
    result = subprocess.run([str(ANSIBLE_PLAYBOOK), "-i", "inventory.yml", playbook, "-e", "@vars.json", *more],
                            cwd=bundle, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env,
                            timeout=2400)
    TIMINGS[step] = time.monotonic() - began
    result.stdout += result.stderr
    print(f"\n[{step}: {TIMINGS[step]:.0f} s] {task_times(result.stdout)}")
    (bundle / f"{step.replace(' ', '_').replace('/', '_')}.log").write_text(result.stdout)
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


FULL_ORDER = "test_full_role_order_keeps_a_newer_image_driver_and_held_nccl"
LANES = 2  # guests booted side by side: each TCG guest runs on its own host core
SELECT = "GPUPROV_VM"  # which scenarios run: "ci" (the default) or "all"
# CI's selection, one job a lane: the full role order (an image whose driver is kept) and the image
# without a driver (the driver installed, the node rebooted): the roles' two driver paths. The
# other profiles (about 6 minutes each here) run with GPUPROV_VM=all.
CI_JOBS = {FULL_ORDER} | {s["id"] for s in SCENARIOS if not s["driver"]}


def selection() -> str:
    value = os.environ.get(SELECT, "ci").strip().lower() or "ci"
    if value not in ("ci", "all"):
        raise pytest.UsageError(f"{SELECT}={value!r} is neither ci nor all")
    return value


def _param(scenario: dict):
    beyond_ci = pytest.mark.skipif(selection() != "all" and scenario["id"] not in CI_JOBS, reason=(
        f"VM TEST SKIPPED for this image profile: CI runs {len(CI_JOBS)} jobs ({SELECT}=ci); {SELECT}=all runs it"))
    return pytest.param(scenario, id=scenario["id"], marks=beyond_ci)


def _boot(work: Path) -> tuple[Guest, float]:
    guest = Guest(work / "guest", drives=0, memory_mb=2048)
    return guest, guest.start()


def _prepare(guest: Guest, work: Path, built: dict, apt_files: Path) -> Path:
    """One guest as an image would start: the stand-in repositories, python3-apt, the stand-in
    Ubuntu archive only (the guest is offline); saved as snapshot `base`."""
    _upload(guest, work.parent / "repo", MOUNT)
    # Ubuntu's images ship python3-apt (Ansible's apt modules need it); the minimal guest
    # gets this machine's copy (same Debian release), files only
    _upload(guest, apt_files, "/")
    kernel = guest.ssh("uname -r").stdout.strip()
    guest.ssh(f"rm -f /etc/apt/sources.list /etc/apt/sources.list.d/* && mkdir -p /etc/apt/keyrings && "
              f"cp {built['ubuntu']['key_file']} /etc/apt/keyrings/standin-ubuntu.asc && "
              f"echo 'deb [signed-by=/etc/apt/keyrings/standin-ubuntu.asc] file:{built['ubuntu']['dir']} ./' "
              f">/etc/apt/sources.list.d/standin-ubuntu.list && apt-get update -q")
    guest.ssh(f"mkdir -p /lib/modules/{kernel}/updates/dkms /var/lib/gpuprov-test && sync")
    # the OS gate pointed at the guest, as Ansible names it (distribution_version is debian_version)
    os_id = "debian-" + guest.ssh("cat /etc/debian_version").stdout.strip()
    bundle = _write_bundle(work, guest, built, os_id)
    TIMINGS[f"savevm base ({work.name})"] = guest.savevm("base")
    return bundle


class Runner:
    """Runs the module's jobs (the full role order, each scenario) on the lanes' guests as they
    come free, in the order the tests were collected; each test waits for its own job's data and
    asserts on it. A job that raised re-raises in its test."""

    def __init__(self, lanes: list, jobs: list[tuple[str, Callable]]):
        self.jobs: queue.Queue = queue.Queue()
        self.done: dict[str, tuple[threading.Event, list]] = {}
        for key, fn in jobs:
            self.done[key] = (threading.Event(), [])
            self.jobs.put((key, fn))
        self.threads = [threading.Thread(target=self._work, args=(lane,), daemon=True) for lane in lanes]
        for thread in self.threads:
            thread.start()

    def _work(self, lane) -> None:
        while True:
            try:
                key, fn = self.jobs.get_nowait()
            except queue.Empty:
                return
            event, box = self.done[key]
            try:
                box.append(("ok", fn(lane)))
            except BaseException as error:  # noqa: BLE001 - handed to the test that waits for it
                box.append(("error", error))
            event.set()

    def result(self, key: str, timeout: float = 3600):
        event, box = self.done[key]
        assert event.wait(timeout), f"job {key} did not finish in {timeout} s"
        kind, value = box[0]
        if kind == "error":
            raise value
        return value

    def join(self, timeout: float = 900) -> None:
        for thread in self.threads:
            thread.join(timeout)


def _selected(request) -> list[str]:
    """The job keys of this module's tests that this session runs (a -k subset runs only those)."""
    keys = []
    for item in request.session.items:
        if item.module is not sys.modules[__name__]:
            continue
        callspec = getattr(item, "callspec", None)
        keys.append(callspec.params["scenario"]["id"] if callspec else item.originalname)
    return [key for key in keys if selection() == "all" or key in CI_JOBS]


def _longest_first(keys: list[str]) -> list[str]:
    """The jobs in the order the lanes take them: the full role order (most roles), then images
    without a driver (install, reboot), then the rest; so no lane is left alone with a long job."""
    bare = {s["id"] for s in SCENARIOS if not s["driver"]}
    def rank(key: str) -> int:
        return 0 if key == FULL_ORDER else 1 if key in bare else 2

    return sorted(keys, key=rank)  # stable: collection order within a rank


@pytest.fixture(scope="module")
def vm(request):
    work = Path(tempfile.mkdtemp(prefix="gpuprov-vm-gpu-"))
    began = time.monotonic()
    guests: list[Guest] = []
    runner = None
    try:
        with concurrent.futures.ThreadPoolExecutor(LANES) as pool:
            booted = list(pool.map(_boot, [work / f"lane{i}" for i in range(LANES)]))
        guests = [guest for guest, _ in booted]
        TIMINGS["boot (side by side)"] = max(seconds for _, seconds in booted)
        kernel = guests[0].ssh("uname -r").stdout.strip()
        kernel_version = guests[0].ssh(f"dpkg-query -W -f='${{Version}}' linux-image-{kernel}").stdout.strip()
        from vm.standin_repo import build

        t0 = time.monotonic()
        built = build(work / "repo", MOUNT, kernel, kernel_version)
        TIMINGS["build stand-in repositories"] = time.monotonic() - t0
        apt_files = _python3_apt(work)
        with concurrent.futures.ThreadPoolExecutor(LANES) as pool:
            bundles = list(pool.map(lambda i: _prepare(guests[i], work / f"lane{i}", built, apt_files),
                                    range(LANES)))
        lanes = [(guest, bundle, built, kernel, work / f"lane{i}")
                 for i, (guest, bundle) in enumerate(zip(guests, bundles))]
        jobs: dict[str, Callable] = {FULL_ORDER: full_order_job}
        jobs.update({s["id"]: functools.partial(scenario_job, scenario=s) for s in SCENARIOS})
        runner = Runner(lanes, [(key, jobs[key]) for key in _longest_first(_selected(request))])
        yield runner
    finally:
        if runner is not None:
            runner.join()
        for guest in guests:
            guest.poweroff()
            guest.kill()
        TIMINGS["module total"] = time.monotonic() - began
        lines = ["GPU roles VM test timings:"] + [f"  {step:<60} {s:7.1f} s" for step, s in TIMINGS.items()]
        (work.parent / "gpuprov-vm-gpu-timings.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        keep = os.environ.get("GPUPROV_VM_KEEP")
        if keep:
            for i in range(LANES):
                shutil.copytree(work / f"lane{i}" / "ansible", Path(keep) / f"lane{i}", dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("roles"))
        shutil.rmtree(work, ignore_errors=True)


def full_order_job(lane) -> dict:
    guest, bundle, built, kernel, work = lane
    TIMINGS["loadvm (full order)"] = guest.loadvm("base")
    cuda = built["cuda"]["dir"]
    # what such an image carries: the CUDA repository's 580 driver (loaded), and NCCL held
    place_module(guest, work, kernel, "580.126.16")
    guest.ssh(f"dpkg -i {cuda}/nvidia-kernel-common-580_580.126.16-1_amd64.deb {cuda}/nvidia-open_580.126.16-1_amd64.deb "
              f"{cuda}/libnccl2_2.21.5-1+cuda12.4_amd64.deb && apt-mark hold libnccl2")
    result = play(bundle, "full role order, newer driver image")
    return {"result": result, "have": packages(guest), "kernel": kernel,
            "rings": guest.ssh("ls /etc/apt/keyrings").stdout.split(),
            "cuda_keyring": guest.ssh("test -f /usr/share/keyrings/cuda-archive-keyring.gpg", check=False).returncode,
            "states": guest.ssh("systemctl is-active nvidia-dcgm nvidia-fabricmanager nvidia-persistenced",
                                check=False).stdout,
            "upgrades": guest.ssh("cat /etc/apt/apt.conf.d/20auto-upgrades", check=False).stdout}


def scenario_job(lane, scenario: dict) -> dict:
    guest, bundle, built, kernel, work = lane
    name = scenario["id"]
    TIMINGS[f"loadvm ({name})"] = guest.loadvm("base")
    place_module(guest, work, kernel, scenario["driver"])
    apply_image(guest, built, scenario)
    before = packages(guest)
    playbook, extra = scenario_play(bundle, scenario)
    first = play(bundle, f"{name} 1", extra, playbook)
    after = packages(guest)
    rerun = play(bundle, f"{name} 2", extra, playbook) if first.returncode == 0 else None
    return {"before": before, "after": after, "first": first, "rerun": rerun, "built": built, "kernel": kernel}


def test_full_role_order_keeps_a_newer_image_driver_and_held_nccl(vm):
    data = vm.result(FULL_ORDER)
    result, have, kernel = data["result"], data["have"], data["kernel"]
    assert result.returncode == 0, result.stdout[-6000:]
    out = result.stdout
    assert "a newer driver is present: keep it" in out
    assert "NCCL is held at 2.21.5-1+cuda12.4: keep it" in out
    assert "nvidia-headless-570-server-open" not in have  # nothing of the older plan branch
    assert have["libnccl2"] == ("2.21.5-1+cuda12.4", "hold") and "libnccl-dev" not in have
    assert have["nvidia-fabricmanager"] == ("580.126.16-1", "hold")  # the running build, its naming
    assert have["doca-ofed"] == ("2.9.1-0.0.1", "hold")  # the planned release, not the newest
    assert have["nccl-gib"] == ("1.1.0", "hold")  # pinned although 1.1.1 is in the repository
    # DCGM by the driver's CUDA major (580 -> 13), pinned, although the plan trains with CUDA 12.8
    assert have["datacenter-gpu-manager-4-cuda13"] == ("1:4.5.2-1", "hold")
    assert "datacenter-gpu-manager-4-cuda12" not in have
    assert have[f"linux-image-{kernel}"][1] == "hold"  # node_baseline holds the running kernel
    assert "libcufile-12-8" in have and "GDS in compat mode" in out
    # keyrings named after the key's form; apt accepted every repository (update ran clean)
    assert {"google-cloud.asc", "google-artifact-registry.gpg", "doca.asc"} <= set(data["rings"]), data["rings"]
    assert data["cuda_keyring"] == 0
    assert data["states"].split()[:2] == ["active", "active"], data["states"]
    assert 'APT::Periodic::Unattended-Upgrade "0"' in data["upgrades"]


def place_module(guest: Guest, work: Path, kernel: str, version: str | None) -> None:
    """The image's driver as the roles see it: a stand-in module `modinfo` reads, and the loaded
    version (for a bare image: the version the driver will load at after the reboot)."""
    from vm.standin_repo import fake_module

    guest.ssh(f"echo {version or BARE_LOADED} >{VERSION_FILE}")
    if version:
        folder = work / f"module-{version}"
        folder.mkdir(exist_ok=True)
        module = fake_module(folder, version)
        subprocess.run(["scp", *guest.ssh_options(), "-P", str(guest.port), str(module),
                        f"root@127.0.0.1:/lib/modules/{kernel}/updates/dkms/nvidia.ko"], check=True,
                       stdin=subprocess.DEVNULL, capture_output=True)
        guest.ssh(f"depmod -a {kernel}")


@pytest.mark.parametrize("scenario", [_param(s) for s in SCENARIOS])
def test_image_profile_converges_adds_only_the_plan_and_reruns_clean(vm, scenario):
    """The roles on one image profile's stand-in: converges, adds exactly what the plan adds
    (nothing the image had moves), and a second run changes nothing."""
    data = vm.result(scenario["id"])
    result, before, after = data["first"], data["before"], data["after"]
    assert result.returncode == 0, result.stdout[-6000:]
    added = {n: after[n][0] for n in set(after) - set(before)}
    assert added == expected_added(scenario, before, data["built"], data["kernel"]), added
    assert set(before) <= set(after) and all(after[n][0] == v for n, (v, _) in before.items()), \
        [(n, v, after.get(n)) for n, (v, _) in before.items() if after.get(n, ("",))[0] != v]
    if scenario["nccl_tests_dir"]:
        assert "use the image nccl-tests build" in result.stdout
    if scenario["efa"]:
        assert f"EFA installer {scenario['efa']} installed, plan 1.43.2: keep it" in " ".join(result.stdout.split())
    rerun = data["rerun"]
    assert rerun.returncode == 0, rerun.stdout[-6000:]
    changed = counters(rerun)["changed"]
    assert changed == 0, "\n".join(line for line in rerun.stdout.splitlines() if line.startswith("changed:"))
