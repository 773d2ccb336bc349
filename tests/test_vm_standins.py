"""Issue 29 finding 11: the VM stand-ins are generated from the image profiles and model the cases
that fail, not only those that pass (no guest needed: this checks what the VM test will install)."""

from __future__ import annotations

import subprocess

import pytest

from gpuprov.catalog.images import profiles as catalog_profiles
from vm.scenarios import BARE_LOADED, expected_added
from vm.standin_profiles import repos, scenarios


def _newer(a: str, b: str) -> bool:
    return subprocess.run(["dpkg", "--compare-versions", a, "gt", b], check=False).returncode == 0


@pytest.fixture(scope="module")
def generated():
    return repos(extra_dcgm=("1:4.5.2-1",)), scenarios()


def test_every_profile_has_a_scenario_and_every_uncertain_possibility_is_run(generated):
    _, found = generated
    by_profile: dict[str, list[dict]] = {}
    for scenario in found:
        for name in scenario["profiles"]:
            by_profile.setdefault(name, []).append(scenario)
    assert set(by_profile) == set(catalog_profiles())
    aws = by_profile["aws-dlami-base-oss-ubuntu2204"]
    assert {s["driver"] for s in aws} == {"580.95.05", "595.91.07"}  # the version and its alternative
    assert {s["fm_installed"] for s in aws} == {True, False}  # uncertain: fabric manager shipped or not
    assert len({s["efa"] for s in aws}) == 2
    gcp = [s for name, group in by_profile.items() if name.startswith("gcp-") for s in group]
    assert {s["fm_installed"] for s in gcp} == {True, False}  # shared uncertainty, taken in turn
    azure = [s for name, group in by_profile.items() if name.startswith("azure-") for s in group]
    assert {any(n == "libnvidia-nscq" for _, n, _ in s["install"]) for s in azure} == {True, False}
    assert {s["driver"] for s in by_profile["oci-gpu-ubuntu2204"]} == {None, "570.172.08"}  # origin unknown


def test_archive_states_ubuntu_keeps_one_build_the_cuda_repository_many(generated):
    built, found = generated
    ubuntu_names = [p["name"] for p in built["ubuntu"]]
    assert len(ubuntu_names) == len(set(ubuntu_names))  # -updates lists only the newest build
    opens = [p["version"] for p in built["cuda"] if p["name"] == "nvidia-open"]
    assert len(opens) >= 3
    azure = next(s for s in found if s["profile"] == "azure-ubuntu-hpc-2204")
    image_build = next(v for _, n, v in azure["install"] if n == "nvidia-open")
    assert any(_newer(v, image_build) for v in opens)  # the repository moved past the image's build
    # NCCL built on the image (azhpc-images install_nccl.sh) is in no index: image-only, held
    assert {("libnccl2", "2.30.4-1+cuda13.0")} <= {(p["name"], p["version"]) for p in built["image"]}
    assert azure["hold"] == ["libnccl2", "libnccl-dev"]


def test_names_and_relations_follow_the_drivers_origin(generated):
    built, found = generated
    cuda = {(p["name"], p["version"]): p for p in built["cuda"]}
    # R580+: unsuffixed fabric manager and NSCQ; R590+: unsuffixed kernel-common too
    assert ("nvidia-fabricmanager", "580.126.16-1") in cuda and ("libnvidia-nscq", "595.91.07-1") in cuda
    assert cuda[("nvidia-fabricmanager", "595.91.07-1")]["depends"] == "nvidia-kernel-common (= 595.91.07-1)"
    # below R580 the CUDA repository's suffixed fabric manager cannot sit beside Ubuntu's -server driver
    assert cuda[("nvidia-fabricmanager-570", "570.172.08-1")]["conflicts"] == "nvidia-kernel-common-570-server"
    ubuntu = {p["name"]: p for p in built["ubuntu"]}
    assert ubuntu["nvidia-fabricmanager-570"]["depends"].startswith("nvidia-kernel-common-570-server (= ")
    gcp = next(s for s in found if s["profile"] == "gcp-a3-mega-ubuntu2204")
    assert all(repo == "ubuntu" for repo, name, _ in gcp["install"] if name.startswith("nvidia"))
    # DCGM: -cudaN Depends -core of the same version, every version side by side
    assert cuda[("datacenter-gpu-manager-4-cuda13", "1:4.6.0-1")]["depends"] == "datacenter-gpu-manager-4-core (= 1:4.6.0-1)"


def test_what_the_plan_adds_is_derived_from_the_image_not_the_run(generated):
    _, found = generated
    built = {"ubuntu": {"packages": [("linux-headers-6.1.0-x", "6.1.1"), ("dkms", "3.0.10-8+deb12u1")]},
             "cuda": {"packages": [("nvlsm", "1"), ("libnvsdm-570", "2")]}}
    bare = next(s for s in found if "onprem-ubuntu-2204[bare]" in s["id"].split("+"))
    added = expected_added(bare, {}, built, "6.1.0-x")
    assert added["nvidia-headless-570-server-open"].startswith(BARE_LOADED + "-0ubuntu")
    assert added["nvidia-fabricmanager-570"] == added["nvidia-kernel-common-570-server"]
    assert added["datacenter-gpu-manager-4-cuda12"] == "1:4.5.2-1"  # 570 serves CUDA 12
    azure = next(s for s in found if s["id"] == "azure-ubuntu-hpc-2204[nscq-installed]")
    before = {name: (version, "install") for _, name, version in azure["install"]} | {"cuda-keyring": ("1.1-1", "")}
    assert expected_added(azure, before, built, "6.1.0-x") == {}  # the image has all the plan needs
