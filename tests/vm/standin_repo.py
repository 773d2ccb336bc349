"""Build signed flat apt repositories of stand-in packages (tests/vm/standin_packages.yaml).

Each repository gets its own throwaway GnuPG key; the key is published in the form the real
vendor uses (armored or binary) under keys/, and Release is signed both ways (InRelease and
Release.gpg) as real repositories are. Packages are built with dpkg-deb from control files and
indexed with dpkg-scanpackages --multiversion (two versions of one name, as real indexes carry).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import subprocess
import textwrap
import time
from pathlib import Path

import yaml

SPEC = Path(__file__).with_name("standin_packages.yaml")
GDSCHECK = (" GDS release version: 1.13.1.3\n nvidia_fs version:  2.24 libcufile version: 2.12\n"
            " NVMe               : Unsupported\n NVMeOF             : Unsupported\n")
STUBS = {
    "stub-daemon": "#!/bin/sh\nexec sleep infinity\n",
    "stub-exit0": "#!/bin/sh\nexit 0\n",
    "stub-gdscheck": "#!/bin/sh\ncat <<'EOF'\n" + GDSCHECK + "EOF\n",
    "stub-env": "# stand-in for the vendor's NCCL environment script\nexport NCCL_NET=gIB\n",
    "stub-lib": "stand-in plugin library\n",
    "stub-ofed-24.10": "#!/bin/sh\necho OFED-internal-24.10-1.1.4:\n",
    "stub-ofed-24.07": "#!/bin/sh\necho OFED-internal-24.07-0.6.1:\n",
}
# DOCA-OFED ships infiniband-diags: its ibstat, with one Active port (no HCA in the guest)
IBSTAT = ("#!/bin/sh\nprintf \"CA 'mlx5_0'\\n\\tCA type: MT4129\\n\\tPort 1:\\n\\t\\tState: Active\\n"
          "\\t\\tPhysical state: LinkUp\\n\\t\\tLink layer: InfiniBand\\n\"\n")


def _gpg(home: Path, *args: str, data: bytes | None = None) -> bytes:
    return subprocess.run(["gpg", "--homedir", str(home), "--batch", "--yes", *args], input=data,
                          check=True, capture_output=True).stdout


def make_key(home: Path, name: str) -> tuple[bytes, bytes]:
    home.mkdir(parents=True, mode=0o700)
    _gpg(home, "--passphrase", "", "--quick-gen-key", f"gpuprov stand-in {name} <{name}@example.invalid>",
         "ed25519", "sign", "never")
    return _gpg(home, "--armor", "--export"), _gpg(home, "--export")


def _unit(command: str, oneshot: bool) -> str:
    kind = "Type=oneshot\nRemainAfterExit=yes\n" if oneshot else ""
    return (f"[Unit]\nDescription=gpuprov stand-in\n\n[Service]\n{kind}ExecStart={command}\n\n"
            "[Install]\nWantedBy=multi-user.target\n")


def build_deb(out: Path, pkg: dict, payload: dict[str, bytes]) -> Path:
    name, version, arch = pkg["name"], str(pkg["version"]), pkg.get("arch", "amd64")
    root = out / f".build-{name}-{version}"
    (root / "DEBIAN").mkdir(parents=True)
    control = [f"Package: {name}", f"Version: {version}", f"Architecture: {arch}",
               "Maintainer: gpuprov tests <tests@example.invalid>", "Section: misc", "Priority: optional"]
    for field in ("depends", "conflicts", "provides"):
        if pkg.get(field):
            control.append(f"{field.capitalize()}: {' '.join(str(pkg[field]).split())}")
    control.append(f"Description: stand-in for {name} {version} (gpuprov VM test)")
    (root / "DEBIAN" / "control").write_text("\n".join(control) + "\n")
    for rel, content in payload.items():
        path = root / rel.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(0o755 if content.startswith(b"#!") else 0o644)
    deb = out / f"{name}_{version.split(':')[-1]}_{arch}.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root), str(deb)],
                   check=True, capture_output=True)
    subprocess.run(["rm", "-rf", str(root)], check=True)
    return deb


def _release(repo: Path, origin: str, label: str) -> str:
    lines = [f"Origin: {origin}", f"Label: {label}", "Architectures: amd64 all",
             "Date: " + time.strftime("%a, %d %b %Y %H:%M:%S UTC", time.gmtime()), "SHA256:"]
    for name in ("Packages", "Packages.gz"):
        data = (repo / name).read_bytes()
        lines.append(f" {hashlib.sha256(data).hexdigest()} {len(data)} {name}")
    return "\n".join(lines) + "\n"


def full_spec() -> dict:
    """standin_packages.yaml's repositories with the packages generated from the image profiles
    (tests/vm/standin_profiles.py) added: Ubuntu's and the CUDA repository's driver, fabric
    manager, NSCQ and DCGM builds, and an `image` repository (never in an apt source) of what
    images carry that no index lists."""
    from vm.standin_profiles import repos

    spec = yaml.safe_load(SPEC.read_text())["repos"]
    generated = repos(extra_dcgm=(str(spec["cuda"]["dcgm_version"]),))
    for name in ("ubuntu", "cuda"):
        seen = {(p["name"], str(p["version"])) for p in spec[name]["packages"]}
        spec[name]["packages"] += [p for p in generated[name] if (p["name"], str(p["version"])) not in seen]
    spec["image"] = {"origin": "local", "key": "binary", "packages": generated["image"],
                     "source": "image-only builds (tests/vm/standin_profiles.py)"}
    return spec


def build(out: Path, mount: str, kernel: str, kernel_version: str) -> dict:
    """All repositories under `out` (the guest sees them at `mount`); returns what was built:
    {repo: {"dir", "origin", "key_form", "key_file", "packages": [(name, version)]}}."""
    spec = full_spec()
    keys_dir = out / "keys"
    keys_dir.mkdir(parents=True)
    built = {}
    for repo_name, repo in spec.items():
        repo_dir = out / repo_name
        repo_dir.mkdir()
        home = out / ".gnupg" / repo_name
        armored, binary = make_key(home, repo_name)
        key = armored if repo["key"] == "armored" else binary
        key_file = keys_dir / f"{repo_name}.{'asc' if repo['key'] == 'armored' else 'gpg'}"
        key_file.write_bytes(key)
        packages = []
        for pkg in repo["packages"]:
            pkg = {k: (v.format(kernel=kernel, kernel_version=kernel_version) if isinstance(v, str) else v)
                   for k, v in pkg.items()}
            payload = {}
            for rel, kind in (pkg.get("files") or {}).items():
                if kind == "key":
                    payload[rel] = binary
                elif kind.startswith("pin:"):
                    # model of NVIDIA's driver pinning package: the driver's packages at one build
                    payload[rel] = (f"Package: nvidia-* libnvidia-*\nPin: version {kind[4:]}\n"
                                    "Pin-Priority: 1000\n").encode()
                elif kind == "source":
                    payload[rel] = (f"deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] "
                                    f"file:{mount}/{repo_name} ./\n").encode()
                else:
                    payload[rel] = STUBS[kind].encode()
            for unit, command in (pkg.get("units") or {}).items():
                payload[f"/lib/systemd/system/{unit}"] = _unit(command, command == "/usr/bin/true").encode()
            if pkg["name"] == "doca-ofed":
                payload["/usr/sbin/ibstat"] = IBSTAT.encode()
            build_deb(repo_dir, pkg, payload)
            packages.append((pkg["name"], str(pkg["version"])))
        index = subprocess.run(["dpkg-scanpackages", "--multiversion", "."], cwd=repo_dir, check=True,
                               capture_output=True).stdout
        (repo_dir / "Packages").write_bytes(index)
        (repo_dir / "Packages.gz").write_bytes(gzip.compress(index))
        release = _release(repo_dir, repo["origin"], f"gpuprov stand-in {repo_name}")
        (repo_dir / "Release").write_text(release)
        (repo_dir / "InRelease").write_bytes(_gpg(home, "--clearsign", data=release.encode()))
        (repo_dir / "Release.gpg").write_bytes(_gpg(home, "--armor", "--detach-sign", data=release.encode()))
        built[repo_name] = {"dir": f"{mount}/{repo_name}", "origin": repo["origin"], "key_form": repo["key"],
                            "key_file": f"{mount}/keys/{key_file.name}", "packages": packages}
    subprocess.run(["rm", "-rf", str(out / ".gnupg")], check=True)
    return built


FAKE_MODULE_C = textwrap.dedent("""\
    /* an ELF object carrying only a .modinfo section: what modinfo/depmod read of a driver */
    static const char modinfo[] __attribute__((section(".modinfo"), used, aligned(1))) =
        "version={version}\\0license=Dual MIT/GPL\\0description=gpuprov stand-in\\0name=nvidia\\0";
    """)


def fake_module(out: Path, version: str) -> Path:
    """A stand-in nvidia.ko that `modinfo nvidia` reports at `version` with the open licence
    (never loadable: it has no code). Stands for the driver an image ships."""
    src = out / "fake-nvidia.c"
    src.write_text(FAKE_MODULE_C.replace("{version}", version))
    obj = out / "nvidia.ko"
    subprocess.run(["gcc", "-c", str(src), "-o", str(obj)], check=True, capture_output=True, env=dict(os.environ))
    return obj
