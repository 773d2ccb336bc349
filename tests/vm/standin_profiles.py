"""Stand-in packages and image states generated from the image profiles (catalog images.yaml).

For every profile this yields the packages its image carries (driver, fabric manager, NSCQ, DCGM,
NCCL: names, versions, origins, Depends/Conflicts) and the archive states the roles meet:

- Ubuntu's -updates index keeps only the newest build of a name: one version per name there, and
  a build an image carries that the index no longer lists is built as an image-only package;
- NVIDIA's CUDA repository keeps many builds: every driver, fabric manager, NSCQ and DCGM build any
  profile names is indexed side by side, so an image's build is usually not the newest there.

Where a profile marks a fact `uncertain:`, scenarios cover each possibility: profiles that share
the same fact (the three GCP images, the two Azure images) take the possibilities in turn; a
profile alone with its fact gets one scenario per possibility.

Relations that public indexes do not settle are this project's model and say so (`model:`).
What the profiles cannot say (DOCA, gIB, GDS, the plan's NCCL, kernel headers) stays in
standin_packages.yaml.
"""

from __future__ import annotations

from pathlib import Path

import yaml

CATALOG = Path(__file__).resolve().parents[2] / "gpuprov" / "catalog" / "data" / "images.yaml"
PLAN_BRANCH = 570  # the roles' default plan branch (nvidia_driver_branch)
DCGM_MAJORS = ("12", "13")
FM_UNIT = {"nvidia-fabricmanager.service": "/usr/bin/sleep infinity"}


def profiles() -> dict[str, dict]:
    return yaml.safe_load(CATALOG.read_text())["profiles"]


def _branch(version: str) -> int:
    return int(version.split(".")[0])


def ubuntu_build(version: str, os: str) -> str:
    return f"{version}-0ubuntu0.{os.split('-')[1]}.1"


def ubuntu_driver(version: str, os: str) -> list[dict]:
    """Ubuntu's -server packages of one driver build (packages.ubuntu.com jammy-updates/restricted:
    nvidia-fabricmanager-<branch> Depends nvidia-kernel-common-<branch>-server)."""
    b, v = _branch(version), ubuntu_build(version, os)
    common = f"nvidia-kernel-common-{b}-server (= {v})"
    return [
        {"name": f"nvidia-kernel-common-{b}-server", "version": v},
        {"name": f"libnvidia-compute-{b}-server", "version": v},
        {"name": f"nvidia-compute-utils-{b}-server", "version": v, "depends": common,
         "files": {"/usr/bin/nvidia-persistenced": "stub-daemon"},
         "units": {"nvidia-persistenced.service": "/usr/bin/nvidia-persistenced"}},
        {"name": f"nvidia-headless-{b}-server-open", "version": v, "conflicts": f"nvidia-headless-{b}-server",
         "depends": f"{common}, nvidia-compute-utils-{b}-server (= {v}), libnvidia-compute-{b}-server (= {v})"},
        {"name": f"nvidia-utils-{b}-server", "version": v, "depends": f"libnvidia-compute-{b}-server (= {v})",
         "files": {"/usr/bin/nvidia-smi": "stub-exit0"}},
        {"name": f"nvidia-fabricmanager-{b}", "version": v, "depends": common, "units": FM_UNIT},
        {"name": f"libnvidia-nscq-{b}", "version": v},
    ]


def cuda_driver(version: str) -> list[dict]:
    """The CUDA repository's packages of one driver build: nvidia-open (R580+) or
    nvidia-driver-<branch>-open, suffixed fabric manager and NSCQ below R580, unsuffixed from R580
    (azhpc-images install_nvidia_fabric_manager.sh@8e9d055), every name unsuffixed from R590
    (NVIDIA driver installation guide, "Ubuntu 590 and later packages"). model: fabric manager
    Depends on the same build's kernel-common and, below R580, Conflicts with Ubuntu's -server one."""
    b, v = _branch(version), f"{version}-1"
    common = "nvidia-kernel-common" if b >= 590 else f"nvidia-kernel-common-{b}"
    suffix = "" if b >= 580 else f"-{b}"
    driver = "nvidia-open" if b >= 580 else f"nvidia-driver-{b}-open"
    fabric = {"name": f"nvidia-fabricmanager{suffix}", "version": v, "depends": f"{common} (= {v})", "units": FM_UNIT}
    if b < 580:
        fabric["conflicts"] = f"nvidia-kernel-common-{b}-server"
    return [{"name": common, "version": v},
            {"name": driver, "version": v, "depends": f"{common} (= {v})",
             "files": {"/usr/bin/nvidia-smi": "stub-exit0", "/usr/bin/nvidia-persistenced": "stub-daemon"},
             "units": {"nvidia-persistenced.service": "/usr/bin/nvidia-persistenced"}},
            fabric, {"name": f"libnvidia-nscq{suffix}", "version": v},
            # azhpc-images: apt install nvidia-driver-pinning-<version> before the driver; model:
            # it ships an apt preferences file holding the driver packages at that build
            {"name": f"nvidia-driver-pinning-{version}", "version": "1.0-1", "arch": "all",
             "files": {f"/etc/apt/preferences.d/nvidia-driver-pinning-{version}": f"pin:{v}"}}]


def dcgm(version: str) -> list[dict]:
    """DCGM 4: -core and one package per CUDA major, each Depends -core of the same version."""
    out = [{"name": "datacenter-gpu-manager-4-core", "version": version}]
    for major in DCGM_MAJORS:
        out.append({"name": f"datacenter-gpu-manager-4-cuda{major}", "version": version,
                    "depends": f"datacenter-gpu-manager-4-core (= {version})",
                    "files": {"/usr/bin/dcgmi": "stub-exit0"},
                    "units": {"nvidia-dcgm.service": "/usr/bin/sleep infinity"}})
    return out


def _driver_builds(profile: dict) -> list[str]:
    driver = profile["driver"]
    return [str(v) for v in [driver.get("version"), *(driver.get("alternatives") or [])] if v]


def repos(extra_dcgm: tuple[str, ...] = ()) -> dict[str, list[dict]]:
    """Packages per repository: 'ubuntu' (one build per name), 'cuda' (many), 'image' (what an image
    carries that no index lists: superseded Ubuntu builds, local builds)."""
    ubuntu: dict[str, dict] = {}
    cuda: dict[tuple, dict] = {}
    image: dict[tuple, dict] = {}
    for profile in profiles().values():
        for build in _driver_builds(profile):
            origin = profile["driver"]["origin"]
            if origin == "ubuntu":
                for pkg in ubuntu_driver(build, profile["os"]):
                    ubuntu.setdefault(pkg["name"], pkg)
            else:  # cuda-repo, and the CUDA-repository possibility of an unknown origin
                for pkg in cuda_driver(build):
                    cuda[(pkg["name"], pkg["version"])] = pkg
        if profile["dcgm"]:
            for pkg in dcgm(str(profile["dcgm"]["version"])):
                cuda[(pkg["name"], pkg["version"])] = pkg
        nccl = profile["nccl"]
        if nccl and nccl.get("version") and nccl.get("origin") == "local-build":
            v = str(nccl["version"])
            image[("libnccl2", v)] = {"name": "libnccl2", "version": v}
            image[("libnccl-dev", v)] = {"name": "libnccl-dev", "version": v, "depends": f"libnccl2 (= {v})"}
    for version in extra_dcgm:
        for pkg in dcgm(version):
            cuda[(pkg["name"], pkg["version"])] = pkg
    return {"ubuntu": list(ubuntu.values()), "cuda": list(cuda.values()), "image": list(image.values())}


def _signature(profile: dict) -> str:
    """The fabric manager fact without its sources and dates, and the driver's origin: profiles
    sharing it share its uncertainty."""
    fm = profile["fabric_manager"] or {}
    return repr((profile["driver"]["origin"], sorted((k, str(v)) for k, v in fm.items() if k not in ("source", "date"))))


def scenarios() -> list[dict]:
    """One image state per profile, more where an uncertain fact is the profile's alone."""
    table = profiles()
    groups: dict[str, list[str]] = {}
    for name, profile in table.items():
        groups.setdefault(_signature(profile), []).append(name)
    out = []
    for name, profile in table.items():
        group = groups[_signature(profile)]
        choices = _choices(profile)
        if len(group) == 1 or len(choices) == 1:
            picks = list(range(len(choices)))
        else:  # shared uncertainty: the profiles of the group take the possibilities in turn
            picks = [group.index(name) % len(choices)]
        out += [_image_state(name, profile, choices[i]) for i in picks]
    return _merge_identical(out)


def _merge_identical(states: list[dict]) -> list[dict]:
    """Profiles whose image states are the same on the guest (a bare Ubuntu on-prem node and a bare
    OCI image; 22.04 and 24.04 meet the one stand-in archive) share one scenario."""
    merged: dict[str, dict] = {}
    for state in states:
        key = repr({k: v for k, v in state.items() if k not in ("id", "profile", "profiles")})
        if key in merged:
            merged[key]["profiles"].append(state["profile"])
            merged[key]["id"] += "+" + state["id"]
        else:
            merged[key] = state
    return list(merged.values())


def _choices(profile: dict) -> list[dict]:
    """The possibilities of the profile's uncertain facts, zipped: each value appears once."""
    builds = _driver_builds(profile)
    driver_origin = profile["driver"]["origin"]
    efa = profile["efa"]
    fm = profile["fabric_manager"]
    fm_uncertain = bool(fm.get("uncertain")) and bool(fm.get("packages"))
    if driver_origin == "unknown":  # no driver (bare) or a CUDA-repository build
        return [{"driver": None, "fm": False, "tag": "bare"}] + [
            {"driver": b, "fm": False, "tag": f"cuda-repo-{b}"} for b in builds]
    if not builds:
        return [{"driver": None, "fm": False, "tag": "bare"}]
    efas = [str(efa["version"]), *(str(a) for a in efa.get("alternatives") or [])][:2] if efa else [None]
    n = max(len(builds), 2 if fm_uncertain else 1)
    out = []
    for i in range(n):
        fm_installed = (i % 2 == 0) if fm_uncertain else bool(fm.get("packages"))
        choice = {"driver": builds[min(i, len(builds) - 1)], "fm": fm_installed,
                  "efa": efas[min(i, len(efas) - 1)], "tag": ""}
        parts = [f"driver-{choice['driver']}"] if len(builds) > 1 else []
        if fm_uncertain:
            label = "nscq" if "nscq" in str(fm["uncertain"]) else "fm"
            parts.append(f"{label}-{'installed' if fm_installed else 'absent'}")
        choice["tag"] = "-".join(parts)
        out.append(choice)
    return out


def _image_state(name: str, profile: dict, choice: dict) -> dict:
    """What to put on the guest before the play: {'id', 'profile', 'install': [(repo, name, version)],
    'hold': [names], 'driver': version or None, 'efa': version or None, 'nccl_tests_dir', 'branch'}."""
    install: list[tuple[str, str, str]] = []
    hold: list[str] = []
    driver = choice["driver"]
    origin = profile["driver"]["origin"]
    if driver and origin == "ubuntu":
        pkgs = {p["name"]: p for p in ubuntu_driver(driver, profile["os"])}
        want = list(profile["driver"]["packages"]) + [f"nvidia-compute-utils-{_branch(driver)}-server",
                                                       f"libnvidia-compute-{_branch(driver)}-server"]
        if choice["fm"]:
            want += list(profile["fabric_manager"]["packages"])
        install += [("ubuntu", n, pkgs[n]["version"]) for n in want]
    elif driver:
        pkgs = {p["name"]: p for p in cuda_driver(driver)}
        b = _branch(driver)
        common = "nvidia-kernel-common" if b >= 590 else f"nvidia-kernel-common-{b}"
        want = [common, "nvidia-open" if b >= 580 else f"nvidia-driver-{b}-open"]
        want += [n for n in profile["driver"]["packages"] if n.startswith("nvidia-driver-pinning")]
        if any(n.startswith("nvidia-driver-pinning") for n in want) and f"nvidia-driver-pinning-{driver}" not in want:
            want = [n for n in want if not n.startswith("nvidia-driver-pinning")] + [f"nvidia-driver-pinning-{driver}"]
        if choice["fm"]:
            # the image's fabric manager (and, where the uncertainty is NSCQ's, NSCQ too)
            want += [n for n in pkgs if n.startswith("nvidia-fabricmanager")]
            if "nscq" in str(profile["fabric_manager"].get("uncertain", "")):
                want += [n for n in pkgs if n.startswith("libnvidia-nscq")]
        install += [("cuda", n, pkgs[n]["version"]) for n in want]
    if profile["dcgm"]:
        v = str(profile["dcgm"]["version"])
        install += [("cuda", "datacenter-gpu-manager-4-core", v),
                    ("cuda", f"datacenter-gpu-manager-4-{profile['dcgm']['flavour']}", v)]
    nccl = profile["nccl"]
    if nccl and nccl.get("version") and nccl.get("origin") == "local-build":
        v = str(nccl["version"])
        install += [("image", "libnccl2", v), ("image", "libnccl-dev", v)]
        if nccl.get("held"):
            hold += ["libnccl2", "libnccl-dev"]
    tests = profile["nccl_tests"]
    tag = choice["tag"]
    return {"id": name + (f"[{tag}]" if tag else ""), "profile": name, "profiles": [name], "install": install, "hold": hold,
            "driver": driver, "branch": max(_branch(driver), PLAN_BRANCH) if driver else PLAN_BRANCH,
            "driver_origin": origin if driver else "none", "fm_installed": choice["fm"],
            "efa": choice.get("efa") if profile["efa"] else None,
            "ofi_nccl_dir": profile["efa"]["ofi_nccl_dir"] if profile["efa"] else None,
            "nccl_tests_dir": tests["dir"] if tests else None,
            "architecture": "blackwell" if any(i.startswith("a4-") for i in profile.get("instances") or ()) else "hopper"}
