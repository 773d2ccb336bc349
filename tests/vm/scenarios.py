"""Image-profile scenarios for the GPU roles' VM test (tests/test_vm_gpu_roles.py).

Each scenario (tests/vm/standin_profiles.py: one per profile, more where an uncertain fact is a
profile's alone) is put on the guest as the image would carry it; the play runs the roles whose
software the profile describes: nvidia_driver (driver, fabric manager, NSCQ, DCGM, persistence)
always, efa where the image has EFA, nccl where it carries NCCL or nccl-tests. DOCA, gIB/TCPXO and
GDS come from repositories the profiles do not describe and are covered by the full-order test.
`expected_added` is what the plan adds to the image, derived from the scenario and the plan's
defaults below, never from what the run did.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from vm.standin_profiles import repos, scenarios, ubuntu_build

VERSION_FILE = "/var/lib/gpuprov-test/nvidia-version"
PLAN_BRANCH = 570  # nvidia_driver_branch in the test's variables
PLAN_DCGM = "1:4.5.2-1"  # nvidia_driver_dcgm_version
PLAN_EFA = "1.43.2"  # efa_installer_version's default
CUDA_KEYRING = "1.1-1"
SCENARIOS = scenarios()
# a bare image loads what the Ubuntu archive lists for the plan's branch (-updates: one build)
BARE_LOADED = next(p["version"] for p in repos()["ubuntu"]
                   if p["name"] == f"nvidia-kernel-common-{PLAN_BRANCH}-server").split("-")[0]
EFA_DEVICE = "provider: efa\n    fabric: efa\n    domain: rdmap16s27-rdm\n    type: FI_EP_RDM\n"


def _image_packages(scenario: dict) -> list[tuple[str, str, str]]:
    install = list(scenario["install"])
    if scenario["driver"] and scenario["driver_origin"] != "ubuntu":
        # an image with a CUDA-repository driver has the repository (cuda-keyring) configured
        install.insert(0, ("cuda", "cuda-keyring", CUDA_KEYRING))
    return install


def apply_image(guest, built: dict, scenario: dict) -> None:
    """Install what the image carries (dpkg -i, as an image build leaves it), its holds, its EFA and
    nccl-tests files."""
    install = _image_packages(scenario)
    steps = []
    if install:
        debs = " ".join(f"{built[repo]['dir']}/{name}_{version.split(':')[-1]}_*.deb" for repo, name, version in install)
        steps.append(f"dpkg -i {debs}")
    if scenario["hold"]:
        steps.append("apt-mark hold " + " ".join(scenario["hold"]))
    if any(name == "cuda-keyring" for _, name, _ in install):
        steps.append("apt-get update -q")
    if scenario["efa"]:
        ofi = scenario["ofi_nccl_dir"]
        steps += [f"mkdir -p {ofi} /opt/amazon/efa/bin",
                  f"printf '# EFA installer version: {scenario['efa']}\\n# Debug packages installed: no\\n' "
                  f">/opt/amazon/efa_installed_packages",
                  f"echo stand-in >{ofi}/libnccl-net-ofi.so",
                  f"printf '#!/bin/sh\\ncat <<EOF\\n{EFA_DEVICE}EOF\\n' >/opt/amazon/efa/bin/fi_info",
                  "chmod +x /opt/amazon/efa/bin/fi_info"]
    if scenario["nccl_tests_dir"]:
        build = f"{scenario['nccl_tests_dir']}/build"
        steps += [f"mkdir -p {build}", f"printf '#!/bin/sh\\nexit 0\\n' >{build}/all_reduce_perf",
                  f"chmod +x {build}/all_reduce_perf"]
    if steps:
        guest.ssh(" && ".join(steps))


def scenario_play(bundle: Path, scenario: dict) -> tuple[str, dict]:
    """The playbook of the roles this profile's software touches, and the scenario's variables."""
    roles = [{"role": "nvidia_driver"}]
    if scenario["efa"]:
        roles.append({"role": "efa"})
    if scenario["nccl_tests_dir"] or any(name == "libnccl2" for _, name, _ in scenario["install"]):
        roles.append({"role": "nccl"})
    name = "scenario-" + "-".join(r["role"] for r in roles) + ".yml"
    (bundle / name).write_text(yaml.safe_dump(
        [{"name": "The roles an image profile's software touches", "hosts": "gpu_nodes", "become": True,
          "gather_subset": ["!all", "min"], "roles": roles}], sort_keys=False))
    extra = {"nvidia_driver_gpu_architecture": scenario["architecture"],
             "nccl_tests_image_dir": scenario["nccl_tests_dir"] or ""}
    return name, extra


def _repo_version(built: dict, repo: str, name: str) -> str:
    versions = [v for n, v in built[repo]["packages"] if n == name]
    assert len(versions) == 1, (repo, name, versions)
    return versions[0]


def expected_added(scenario: dict, before: dict, built: dict, kernel: str) -> dict[str, str]:
    """name -> version of every package the plan adds to this image."""
    add: dict[str, str] = {}
    driver = scenario["driver"]
    loaded = driver or BARE_LOADED
    branch = int(loaded.split(".")[0])
    ubuntu = not driver or scenario["driver_origin"] == "ubuntu"
    if not driver:  # the plan's branch from Ubuntu's -server packages, with DKMS and headers
        version = ubuntu_build(loaded, "ubuntu-22.04")
        for name in (f"nvidia-headless-{branch}-server-open", f"nvidia-utils-{branch}-server",
                     f"nvidia-kernel-common-{branch}-server", f"nvidia-compute-utils-{branch}-server",
                     f"libnvidia-compute-{branch}-server"):
            add[name] = version
        for name in (f"linux-headers-{kernel}", "dkms"):
            add[name] = _repo_version(built, "ubuntu", name)
    # fabric manager and NSCQ at the loaded build, from the driver's repository and naming
    if ubuntu:
        names, version = [f"nvidia-fabricmanager-{branch}", f"libnvidia-nscq-{branch}"], ubuntu_build(loaded, "ubuntu-22.04")
    else:
        suffix = "" if branch >= 580 else f"-{branch}"
        names, version = [f"nvidia-fabricmanager{suffix}", f"libnvidia-nscq{suffix}"], f"{loaded}-1"
    add.update({name: version for name in names})
    if scenario["architecture"] == "blackwell":
        for name in ("nvlsm", f"libnvsdm-{branch}"):
            add[name] = _repo_version(built, "cuda", name)
    if not any(name.startswith("datacenter-gpu-manager") for name in before):
        major = "13" if branch >= 580 else "12"
        add.update({"datacenter-gpu-manager-4-core": PLAN_DCGM, f"datacenter-gpu-manager-4-cuda{major}": PLAN_DCGM})
    add["cuda-keyring"] = CUDA_KEYRING
    return {name: version for name, version in add.items() if name not in before}
