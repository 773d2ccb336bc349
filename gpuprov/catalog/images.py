"""Image profiles (data/images.yaml): what each image the bundles boot already carries.

Pure lookups: the planner names the profile a plan assumes (plan.software.image_profile), and
the Ansible renderer passes the facts the roles need (driver origin, nccl-tests location, DCGM
pin) into group_vars.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from gpuprov.catalog import load_data
from gpuprov.errors import GpuprovError

COMPONENTS = ("kernel", "driver", "fabric_manager", "rdma", "efa", "nccl", "dcgm", "nccl_tests", "cuda", "slurm")
# cloud-init's manage_etc_hosts as an image sets it (None: unset, which cloud-init takes as false;
# "template" is the deprecated spelling of true)
MANAGE_ETC_HOSTS = (None, False, True, "localhost", "template")


@lru_cache(maxsize=None)
def _data() -> dict:
    data = load_data("images.yaml")
    for name, profile in data["profiles"].items():
        for part in COMPONENTS:
            if part not in profile:
                raise ValueError(f"images.yaml: profile {name} lacks {part}")
            entry = profile[part]
            if entry is not None and not (entry.get("source") and entry.get("date")):
                raise ValueError(f"images.yaml: {name}.{part} needs source and date")
        hosts = profile.get("cloud_init") or {}
        if not (hosts.get("source") and hosts.get("date")) or hosts.get("manage_etc_hosts", "") not in MANAGE_ETC_HOSTS:
            raise ValueError(f"images.yaml: {name}.cloud_init needs manage_etc_hosts (one of {MANAGE_ETC_HOSTS}), source and date")
    return data


def profiles() -> dict[str, dict]:
    return _data()["profiles"]


def profile(name: str) -> dict:
    try:
        return profiles()[name]
    except KeyError:
        raise GpuprovError(f"unknown image profile {name!r}; known: {', '.join(sorted(profiles()))}") from None


def profile_for(cloud: str, instance: str) -> str:
    """The profile a plan on this cloud and instance type assumes."""
    default = None
    for name, entry in profiles().items():
        if entry["cloud"] != cloud:
            continue
        if any(instance.startswith(prefix) for prefix in entry.get("instances") or ()):
            return name
        if entry.get("default"):
            default = default or name
    if default is None:
        raise GpuprovError(f"no image profile for cloud {cloud}")
    return default


def manage_etc_hosts(name: str) -> tuple:
    """The manage_etc_hosts values a host of this profile may boot with: the one recorded, or every
    value cloud-init takes where the sources leave the image's setting open."""
    entry = profile(name)["cloud_init"]
    return MANAGE_ETC_HOSTS if entry.get("uncertain") else (entry["manage_etc_hosts"],)


def dcgm_rule() -> dict[str, Any]:
    return _data()["dcgm"]


def dcgm_cuda_major(driver_branch: int) -> str:
    """The CUDA major whose DCGM flavour serves a driver of this branch (580 -> 13)."""
    rule = dcgm_rule()["cuda_major_by_min_branch"]
    fitting = [int(major) for major, least in rule.items() if driver_branch >= int(least)]
    if not fitting:
        raise GpuprovError(f"no DCGM 4 flavour for driver branch {driver_branch}")
    return str(max(fitting))


def uncertain(name: str) -> dict[str, str]:
    """component -> what public material does not settle, for this profile."""
    entry = profile(name)
    return {part: " ".join(str(entry[part]["uncertain"]).split())
            for part in COMPONENTS if entry[part] and entry[part].get("uncertain")}


def image_profile(cloud: str, instance: str) -> Any:
    """The plan's ImageProfile for this cloud and instance type."""
    from gpuprov.plan import ImageProfile

    name = profile_for(cloud, instance)
    entry, rule = profile(name), dcgm_rule()
    tests = entry["nccl_tests"]
    sources = {str(entry[part]["source"]) for part in COMPONENTS if entry[part]}
    return ImageProfile(name=name, nccl_tests_dir=tests["dir"] if tests else None,
                        nccl_tests_mpi_env=dict((tests or {}).get("mpi_env") or {}),
                        dcgm_version=str(rule["version"]),
                        dcgm_cuda_major_by_min_branch={str(k): int(v) for k, v in rule["cuda_major_by_min_branch"].items()},
                        uncertain=uncertain(name), source="; ".join(sorted(sources)))
