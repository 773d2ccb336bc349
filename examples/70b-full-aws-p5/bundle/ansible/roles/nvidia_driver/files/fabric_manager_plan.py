"""Decide fabric manager and NSCQ for the loaded driver, after the installed driver's origin.

Fabric manager must be the loaded driver's exact version and come from the same repository as the
driver: Ubuntu's nvidia-fabricmanager-<branch> depends on Ubuntu's -server kernel-common, the CUDA
repository's builds follow the CUDA repository's driver (unsuffixed nvidia-fabricmanager from R580).
What is installed at the loaded version is kept; nothing is downgraded. Versions are compared in
Debian order (python-apt, else dpkg --compare-versions), never as strings.

Usage: fabric_manager_plan.py <loaded driver version> <branch>
Prints JSON: {"flavour", "keep": [name], "install": ["name=version"], "missing": [component],
"held": [name of a kept package already on hold]}.
"""

import json
import subprocess
import sys


def compare(a, b):
    """<0, 0, >0 as Debian orders two versions."""
    try:
        import apt_pkg

        apt_pkg.init_system()
        return apt_pkg.version_compare(a, b)
    except ImportError:
        for op, result in (("lt", -1), ("gt", 1)):
            if subprocess.run(["dpkg", "--compare-versions", a, op, b], check=False).returncode == 0:
                return result
        return 0


def upstream(version):
    return version.split(":")[-1].rsplit("-", 1)[0]


def candidates(branch, flavour):
    """Package names per component, the preferred first."""
    if flavour == "cuda-repo" and int(branch) >= 580:
        return {"fabric manager": ["nvidia-fabricmanager", f"nvidia-fabricmanager-{branch}"],
                "nscq": ["libnvidia-nscq", f"libnvidia-nscq-{branch}"]}
    return {"fabric manager": [f"nvidia-fabricmanager-{branch}"], "nscq": [f"libnvidia-nscq-{branch}"]}


def _best(versions, cmp):
    best = versions[0]
    for version in versions[1:]:
        best = version if cmp(version, best) > 0 else best
    return best


def decide(loaded, branch, installed, available, cmp=compare):
    """installed: name -> version; available: name -> [(version, origin)]."""
    flavour = "ubuntu" if f"nvidia-kernel-common-{branch}-server" in installed else "cuda-repo"
    out = {"flavour": flavour, "keep": [], "install": [], "missing": []}
    for component, names in candidates(branch, flavour).items():
        # kept: the loaded version, or a newer build (never downgraded)
        have = [n for n in names if n in installed and cmp(upstream(installed[n]), loaded) >= 0]
        if have:
            out["keep"].append(have[0])
            continue
        for name in names:
            builds = [v for v, origin in available.get(name, ())
                      if upstream(v) == loaded and (origin == "Ubuntu") == (flavour == "ubuntu")]
            if builds:
                out["install"].append(f"{name}={_best(builds, cmp)}")
                break
        else:
            out["missing"].append(component)
    return out


def _apt_state(names):
    import apt_pkg

    apt_pkg.init()
    cache = apt_pkg.Cache(progress=None)
    installed, available, held = {}, {}, set()
    for name in names:
        if name not in cache:
            continue
        pkg = cache[name]
        if pkg.current_ver is not None and pkg.current_state == apt_pkg.CURSTATE_INSTALLED:
            installed[name] = pkg.current_ver.ver_str
            if pkg.selected_state == apt_pkg.SELSTATE_HOLD:
                held.add(name)
        available[name] = [(v.ver_str, pf.origin) for v in pkg.version_list for pf, _ in v.file_list
                           if pf.archive != "now"]
    return installed, available, held


def main(argv):
    loaded, branch = argv[0], argv[1]
    names = {f"nvidia-kernel-common-{branch}-server"}
    for flavour in ("ubuntu", "cuda-repo"):
        for group in candidates(branch, flavour).values():
            names.update(group)
    installed, available, held = _apt_state(sorted(names))
    plan = decide(loaded, branch, installed, available)
    plan["held"] = sorted(held & set(plan["keep"]))  # the role holds the rest
    print(json.dumps(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
