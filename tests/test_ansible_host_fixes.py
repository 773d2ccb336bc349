"""Regression tests for the host roles' blockers on real GPU images (issue 14, findings 1-13).

The decisions run for real in ansible-playbook (connection local) from the roles' own task files,
fed what the probes would find on a GPU image (fake tools printing the real tools' formats on
PATH, or the probe results directly). Structure checks read the role files where the behaviour
needs hardware (a reboot, apt against NVIDIA's repositories); tests/test_vm_gpu_roles.py runs the
package logic against a signed stand-in apt repository in the qemu guest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from ansible_helpers import REPO, os_id, playbook, private_dir, recap, write_files, write_local_inventory
from gpuprov.catalog import load_data
from gpuprov.catalog.fabrics import fabric_allreduce_threshold, get_fabric, get_software
from gpuprov.render.ansible import render_ansible
from plan_fixtures import sample_plan
from ports import free_port

ROLES = REPO / "ansible" / "roles"
CLOUDS = ("aws", "gcp", "azure", "oci", "onprem")


@pytest.fixture(scope="module")
def bundle():
    with private_dir("fixes") as root:
        write_files(root, render_ansible(sample_plan("aws")))
        write_local_inventory(root)
        yield root


def _tasks(path: Path) -> list[dict]:
    return yaml.safe_load(path.read_text()) or []


def _role_files(pattern: str = "*.yml"):
    return sorted(ROLES.rglob(pattern))


def _preflight_ok() -> dict:
    return {"gpu_preflight_supported_os": [os_id()], "gpu_preflight_require_gpu": False}


def _fake_bin(root: Path, tools: dict[str, str]) -> Path:
    """Stand-in binaries (sh scripts) printing what the real tools print, first on PATH."""
    fake = root / "fake-bin"
    fake.mkdir(exist_ok=True)
    for name, body in tools.items():
        path = fake / name
        path.write_text("#!/bin/sh\n" + body + "\n")
        path.chmod(0o755)
    return fake


def _run_cases(bundle: Path, name: str, role: str, tasks_from: str, cases: list[dict],
               fake: Path | None = None, report: str | None = None, extra: dict | None = None,
               ignore: bool = True) -> str:
    """One playbook run, one include_role per case (errors ignored, each printed); with `report`
    (a Jinja expression), its value after each case is written to reports/<name>/<i>.json."""
    tasks = []
    apply: dict = {"ignore_errors": ignore}
    if fake is not None:
        apply["environment"] = {"PATH": f"{fake}:{os.environ['PATH']}"}
    out_dir = bundle / "reports" / name
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    for i, case in enumerate(cases):
        tasks.append({"name": f"case {i}", "ansible.builtin.include_role": {
            "name": role, "tasks_from": tasks_from, "apply": apply}, "vars": case})
        if report:
            tasks.append({"name": f"report {i}", "ansible.builtin.copy": {
                "content": f"{{{{ {report} | to_json }}}}", "dest": str(out_dir / f"{i}.json"), "mode": "0644"}})
    (bundle / name).write_text(yaml.safe_dump([{
        "name": "test", "hosts": "gpu_nodes", "gather_facts": True, "gather_subset": ["!all", "network"],
        "vars": {**_preflight_ok(), **(extra or {})}, "tasks": tasks}], sort_keys=False))
    result = playbook(bundle, "-i", "local-inventory.yml", name)
    assert result.returncode == 0 or not ignore, result.stdout[-4000:]
    return result.stdout


def _reports(bundle: Path, name: str) -> dict[int, object]:
    return {int(p.stem): json.loads(p.read_text()) for p in (bundle / "reports" / name).glob("*.json")}


# ------------------------------------------------------------------ 1. apt keys (gIB)


def _gpg_keys(root: Path) -> tuple[bytes, bytes]:
    home = root / "gnupg"
    home.mkdir(mode=0o700)
    env = dict(os.environ, GNUPGHOME=str(home))
    subprocess.run(["gpg", "--batch", "--passphrase", "", "--quick-gen-key", "gpuprov-test <t@example.invalid>",
                    "ed25519", "sign", "never"], check=True, env=env, capture_output=True)
    armored = subprocess.run(["gpg", "--armor", "--export"], check=True, env=env, capture_output=True).stdout
    binary = subprocess.run(["gpg", "--export"], check=True, env=env, capture_output=True).stdout
    return armored, binary


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gpg") is None, reason="gpg not installed")
def test_apt_keyring_names_each_key_for_its_form(bundle):
    with private_dir("keys") as root:
        armored, binary = _gpg_keys(root)
        (root / "armored.gpg").write_bytes(armored)  # published as .gpg, content armored (Google's)
        (root / "binary.key").write_bytes(binary)
        rings = root / "keyrings"
        rings.mkdir()
        (rings / "google.gpg").write_bytes(armored)  # what the old role left: armored in a .gpg
        cases = [{"gpu_preflight_key_url": f"file://{root}/armored.gpg", "gpu_preflight_keyring": f"{rings}/google"},
                 {"gpu_preflight_key_url": f"file://{root}/binary.key", "gpu_preflight_keyring": f"{rings}/vendor"}]
        first = _run_cases(bundle, "keys.yml", "gpu_preflight", "apt_keyring.yml", cases, report="gpu_preflight_keyrings")
        assert "...ignoring" not in first
        found = _reports(bundle, "keys.yml")[1]
        assert found == {f"{rings}/google": f"{rings}/google.asc", f"{rings}/vendor": f"{rings}/vendor.gpg"}
        assert (rings / "google.asc").read_bytes() == armored and not (rings / "google.gpg").exists()
        assert (rings / "vendor.gpg").read_bytes() == binary and not (rings / "vendor.asc").exists()
        again = _run_cases(bundle, "keys.yml", "gpu_preflight", "apt_keyring.yml", cases)
        assert recap(again)["changed"] == 0


def test_every_signed_by_names_a_keyring_in_its_real_form():
    """An armored key must never be named as a .gpg keyring: every repository either uses the
    keyring apt_keyring.yml wrote (suffix from the key's form) or an .asc file."""
    seen = 0
    for path in _role_files():
        text = path.read_text()
        code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
        for match in re.finditer(r"signed-by=(\{\{.*?\}\}|[^\] ]+)", code):
            seen += 1
            target = match.group(1)
            assert target.startswith("{{ gpu_preflight_keyrings[") or target.endswith(".asc"), f"{path}: {target}"
        for task in _tasks(path) if path.parent.name == "tasks" else []:
            url = task.get("ansible.builtin.get_url") if isinstance(task, dict) else None
            if url and "keyring" in str(url.get("dest", "")):
                assert not str(url["dest"]).endswith(".gpg"), f"{path}: a key fetched straight into a .gpg"
    assert seen >= 5  # gIB, transport, TCPXO, container toolkit, DOCA


def test_gib_plugin_version_is_pinned_and_held():
    sw = get_software("hopper", "roce", True, gpu="h100-80gb", cloud="gcp")
    assert sw.nccl_gib_version == load_data("software.yaml")["gcp_gib"]["nccl_gib_version"]
    assert get_software("hopper", "roce", True, gpu="h100-80gb", cloud="oci").nccl_gib_version is None
    tasks = _tasks(ROLES / "gcp_rdma" / "tasks" / "gib.yml")
    install = next(t for t in tasks if "ansible.builtin.apt" in t and "gcp_rdma_gib_package" in str(t))
    assert "{{ gcp_rdma_gib_package }}={{ gcp_rdma_gib_version }}*" in install["ansible.builtin.apt"]["name"]
    hold = next(t for t in tasks if "ansible.builtin.dpkg_selections" in t)
    assert hold["ansible.builtin.dpkg_selections"] == {"name": "{{ gcp_rdma_gib_package }}", "selection": "hold"}
    repo = next(t for t in tasks if "ansible.builtin.apt_repository" in t)["ansible.builtin.apt_repository"]["repo"]
    assert "ar+https://us-apt.pkg.dev/projects/gce-ai-infra" in load_data_default("gcp_rdma", "gcp_rdma_gib_repo")
    assert "signed-by={{ gpu_preflight_keyrings[" in repo


def load_data_default(role: str, name: str):
    return yaml.safe_load((ROLES / role / "defaults" / "main.yml").read_text())[name]


# ------------------------------------------------------------------ 2. TCPXO


def test_tcpxo_environment_and_host_setup_follow_googles_reference():
    fabric = get_fabric("tcpxo", "gcp", "a3-megagpu-8g")
    env = fabric.nccl_env
    assert env["NCCL_FASTRAK_CTRL_DEV"] == env["NCCL_SOCKET_IFNAME"] == "enp0s12"
    assert env["NCCL_FASTRAK_IFNAME"].split(",") == fabric.gpu_nics and len(fabric.gpu_nics) == 8
    assert fabric.nccl_net == "FasTrak"
    from gpuprov.render.launch import render_launch

    plan = sample_plan("gcp")
    text = render_launch(plan)["env.sh"]
    profile_at = text.index(". /var/lib/tcpxo/lib64/nccl-env-profile.sh")
    assert text.index("gpuprov_nccl_env", profile_at) > profile_at  # exported again after the profile
    assert "export NCCL_FASTRAK_IFNAME=enp6s0,enp7s0,enp13s0,enp14s0,enp134s0,enp135s0,enp141s0,enp142s0" in text
    gv = yaml.safe_load(render_ansible(plan)["group_vars/all.yml"])
    assert gv["gcp_rdma_gpu_nics"] == fabric.gpu_nics and gv["gcp_rdma_gpu_nic_count"] == 8

    tasks = _tasks(ROLES / "gcp_rdma" / "tasks" / "tcpxo.yml")
    apt_names = [n for t in tasks if "ansible.builtin.apt" in t for n in (t["ansible.builtin.apt"]["name"]
                 if isinstance(t["ansible.builtin.apt"]["name"], list) else [t["ansible.builtin.apt"]["name"]])]
    assert {"docker.io", "nvidia-container-toolkit", "dmabuf-import-helper"} <= set(apt_names)
    assert any("nvidia-ctk runtime configure --runtime=docker" in str(t) for t in tasks)
    assert any("modprobe import-helper" in str(t) for t in tasks)
    rule = (ROLES / "gcp_rdma" / "templates" / "tcpxo-aperture.rules.j2").read_text()
    assert 'ATTR{vendor}=="0x1ae0", ATTR{device}=="0x0084"' in rule and "/dev/aperture_devices/%k" in rule
    unit = (ROLES / "gcp_rdma" / "templates" / "tcpxo-rxdm.service.j2").read_text()
    for part in ("--num_hops=2 --num_nics=8 --uid= --alsologtostderr", "--device /dev/dmabuf_import_helper",
                 "/sys:/hostsysfs", "/proc/sys:/hostprocsysfs", "--cap-add=NET_BIND_SERVICE", "--gpus all"):
        assert part in unit


# ------------------------------------------------------------------ 3. GDS modes


def test_gds_mode_is_decided_per_platform_and_reaches_roles():
    modes = load_data("software.yaml")["gds_modes"]
    for cloud in CLOUDS:
        assert modes[cloud] in ("nvidia-fs", "compat")
        plan = sample_plan(cloud)
        plan = plan.model_copy(update={"software": get_software("hopper", plan.fabric.name, True, gpu="h100-80gb",
                                                                cloud=cloud)})
        assert plan.software.gds_mode == modes[cloud]
        gv = yaml.safe_load(render_ansible(plan)["group_vars/all.yml"])
        assert gv["gds_mode"] == gv["healthcheck_gds_mode"] == modes[cloud]
    from gpuprov.render.report import render_report

    readme = render_report(plan)["README.md"]
    assert "GPUDirect Storage (compatibility mode: POSIX reads; nvidia-fs needs DOCA's GDS-enabled NVMe driver)" in readme
    tasks = _tasks(ROLES / "gds" / "tasks" / "main.yml")
    guard = next(t for t in tasks if t["name"].startswith("Stop when nvidia-fs mode"))
    assert "gds_nvme_driver" in str(guard) and guard["when"] == "gds_mode == 'nvidia-fs'"


GDSCHECK = """ GDS release version: 1.13.1.3
 nvidia_fs version:  2.24 libcufile version: 2.12
 ============
 ENVIRONMENT:
 ============
 =====================
 DRIVER CONFIGURATION:
 =====================
 NVMe               : {nvme}
 NVMeOF             : Unsupported"""


@pytest.mark.slow
def test_gds_health_reports_the_mode_it_found(bundle):
    with private_dir("gds") as root:
        fake = _fake_tool_dir(root, {"gds-supported": GDSCHECK.format(nvme="Supported"),
                                     "gds-unsupported": GDSCHECK.format(nvme="Unsupported")})
        out = _run_cases(bundle, "gds.yml", "healthcheck", "gds.yml", [
            {"healthcheck_gdscheck_bin": f"{fake}/gds-unsupported", "healthcheck_gds_mode": "compat"},
            {"healthcheck_gdscheck_bin": f"{fake}/gds-supported", "healthcheck_gds_mode": "nvidia-fs"},
            {"healthcheck_gdscheck_bin": f"{fake}/gds-unsupported", "healthcheck_gds_mode": "nvidia-fs"},
        ])
    assert "GDS mode found: compatibility (POSIX reads); planned compat" in out
    assert "GDS mode found: nvidia-fs (NVMe Supported); planned nvidia-fs" in out
    assert "planned mode nvidia-fs, found compatibility mode" in out
    assert out.count("...ignoring") == 1


def _fake_tool_dir(root: Path, outputs: dict[str, str]) -> Path:
    return _fake_bin(root, {name: f"cat <<'EOF'\n{text}\nEOF" for name, text in outputs.items()})


# ------------------------------------------------------------------ 4, 5. driver: never downgrade, one flavour


OPEN_580 = "filename: /lib/modules/x/updates/dkms/nvidia.ko\nversion:        580.65.06\nlicense:        Dual MIT/GPL\n"
PROP_580 = "version:        580.65.06\nlicense:        NVIDIA\n"
OPEN_550 = "version:        550.163.01\nlicense:        Dual MIT/GPL\n"
OPEN_570 = "version:        570.172.08\nlicense:        Dual MIT/GPL\n"


@pytest.mark.slow
def test_driver_decision_keeps_newer_drivers_and_installs_only_older_or_missing(bundle):
    facts = ("{'install': nvidia_driver_needs_install | bool, 'branch': nvidia_driver_effective_branch | int, "
             "'reboot': nvidia_driver_reboot_pending | bool, 'flavour_ok': nvidia_driver_flavour_ok | bool}")
    cases = [
        {"nvidia_driver_probe_loaded": "", "nvidia_driver_probe_modinfo": ""},                 # bare image
        {"nvidia_driver_probe_loaded": "580.65.06", "nvidia_driver_probe_modinfo": OPEN_580},  # Azure/GCP images
        {"nvidia_driver_probe_loaded": "550.163.01", "nvidia_driver_probe_modinfo": OPEN_550},  # older: upgrade
        {"nvidia_driver_probe_loaded": "570.172.08", "nvidia_driver_probe_modinfo": OPEN_570},  # exactly right
        {"nvidia_driver_probe_loaded": "570.172.08", "nvidia_driver_probe_modinfo": OPEN_580},  # reboot pending
        {"nvidia_driver_probe_loaded": "", "nvidia_driver_probe_modinfo": PROP_580},
    ]
    out = _run_cases(bundle, "driver.yml", "nvidia_driver", "decide.yml", cases, report=facts,
                     extra={"nvidia_driver_branch": "570", "nvidia_driver_open_kernel_modules": True})
    got = _reports(bundle, "driver.yml")
    assert got[0] == {"install": True, "branch": 570, "reboot": False, "flavour_ok": False}
    assert got[1] == {"install": False, "branch": 580, "reboot": False, "flavour_ok": True}
    assert got[2] == {"install": True, "branch": 570, "reboot": False, "flavour_ok": True}
    assert got[3] == {"install": False, "branch": 570, "reboot": False, "flavour_ok": True}
    assert got[4] == {"install": False, "branch": 580, "reboot": True, "flavour_ok": True}
    assert got[5] == {"install": False, "branch": 580, "reboot": False, "flavour_ok": False}
    main = (ROLES / "nvidia_driver" / "tasks" / "main.yml").read_text()
    assert "nvidia_driver_gpu_architecture == 'blackwell'" in main  # a kept proprietary driver stops Blackwell only


def test_no_role_overrides_holds_or_downgrades():
    for path in _role_files():
        for task in _all_tasks(path):
            for module in ("ansible.builtin.apt", "ansible.builtin.package"):
                args = task.get(module) if isinstance(task.get(module), dict) else {}
                assert "allow_change_held_packages" not in args and "allow_downgrade" not in args, path


def _all_tasks(path: Path) -> list[dict]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return []
    return [t for t in data if isinstance(t, dict)] if isinstance(data, list) else []


def test_driver_and_fabric_manager_use_one_flavour_from_one_repository(bundle):
    defaults = yaml.safe_load((ROLES / "nvidia_driver" / "defaults" / "main.yml").read_text())
    for name in defaults["nvidia_driver_packages_open"] + defaults["nvidia_driver_packages_proprietary"]:
        assert re.search(r"-server(-open)?$", name), name
    with private_dir("pin") as root:
        dest = root / "pin.pref"
        (bundle / "pin.yml").write_text(yaml.safe_dump([{"name": "pin", "hosts": "gpu_nodes", "gather_facts": False,
            "vars": {"nvidia_driver_branch": "570", "nvidia_driver_package_origin": "Ubuntu"},
            "tasks": [{"name": "pin", "ansible.builtin.template": {
                "src": "roles/nvidia_driver/templates/nvidia-driver-pin.pref.j2", "dest": str(dest), "mode": "0644"}}]}]))
        result = playbook(bundle, "-i", "local-inventory.yml", "pin.yml")
        assert result.returncode == 0, result.stdout[-2000:]
        stanza = dest.read_text()
    assert "Package: *-570-server* nvidia-fabricmanager-570 libnvidia-nscq-570" in stanza
    assert "Pin: release o=Ubuntu" in stanza and "Pin-Priority: 900" in stanza
    fm = (ROLES / "nvidia_driver" / "tasks" / "fabric_manager.yml").read_text()
    assert "nvidia_driver_effective_branch" in fm  # the branch the node runs, not the plan's
    assert "fabric_manager_plan.py" in fm  # the driver's origin and naming decide (unit tests below)


NCCL_STATES = {
    "held": "printf 'hold ok installed|2.27.3-1+cuda12.9'",
    "newer": "printf 'install ok installed|2.28.3-1+cuda12.9'",
    "older": "printf 'install ok installed|2.21.5-1+cuda12.4'",
    "absent": "exit 1",
}


@pytest.mark.slow
def test_nccl_keeps_a_held_or_newer_libnccl2(bundle):
    with private_dir("nccl") as root:
        outputs = {}
        for state, body in NCCL_STATES.items():
            fake = root / state
            fake.mkdir()
            _fake_bin(fake, {"dpkg-query": body})
            out = _run_cases(bundle, f"nccl-{state}.yml", "nccl", "probe.yml", [{}], fake=fake / "fake-bin",
                             report="[nccl_state, nccl_found_version]", extra={"nccl_version": "2.26.2-1+cuda12.8"})
            outputs[state] = _reports(bundle, f"nccl-{state}.yml")[0]
    assert outputs == {"held": ["held", "2.27.3-1+cuda12.9"], "newer": ["newer-or-same", "2.28.3-1+cuda12.9"],
                       "older": ["older", "2.21.5-1+cuda12.4"], "absent": ["absent", ""]}
    install = next(t for t in _tasks(ROLES / "nccl" / "tasks" / "main.yml") if t["name"].startswith("Install NCCL"))
    assert "nccl_state in ['absent', 'older']" in install["when"]


# ------------------------------------------------------------------ 6, 7, 8. DOCA order, opensm retries, OCI


@pytest.mark.slow
def test_doca_decision_compares_the_doca_package_not_ofed_info(bundle):
    base = {"infiniband_stack": "doca", "infiniband_doca_version": "2.9.1"}
    cases = [
        {**base, "infiniband_probe_ofed": "", "infiniband_probe_doca": ""},  # nothing: install
        {**base, "infiniband_probe_ofed": "OFED-internal-24.10-1.1.4:", "infiniband_probe_doca": "2.9.1-0.0.1"},
        {**base, "infiniband_probe_ofed": "OFED-internal-24.07-0.6.1:", "infiniband_probe_doca": "2.8.0-0.0.3"},
        {**base, "infiniband_probe_ofed": "MLNX_OFED_LINUX-23.10-1.1.9.0:", "infiniband_probe_doca": ""},
        {**base, "infiniband_probe_ofed": "MLNX_OFED_LINUX-23.10-1.1.9.0:", "infiniband_probe_doca": "",
         "infiniband_doca_replace": True},
        {**base, "infiniband_probe_ofed": "", "infiniband_probe_doca": "2.9.10-1"},  # newer than 2.9.1: kept
        {"infiniband_stack": "image", "infiniband_probe_ofed": "", "infiniband_probe_doca": ""},
    ]
    got = (_run_cases(bundle, "doca.yml", "infiniband", "decide_doca.yml", cases,
                                report="infiniband_doca_install | bool"), _reports(bundle, "doca.yml"))[1]
    assert [got[i] for i in range(len(cases))] == [True, False, True, False, True, False, False]


def test_site_orders_doca_before_the_driver_and_peermem_after():
    for cloud in ("azure", "oci", "onprem"):
        site = yaml.safe_load(render_ansible(sample_plan(cloud))["site.yml"])
        gpu_play = next(p for p in site if p.get("name") == "GPU driver, fabric and NCCL")
        order = [(r["role"], (r.get("vars") or {}).get("infiniband_phase")) for r in gpu_play["roles"]]
        assert order[:3] == [("infiniband", "stack"), ("nvidia_driver", None), ("infiniband", "peermem")]
    handlers = (ROLES / "infiniband" / "handlers" / "main.yml").read_text()
    assert "name: openibd" in handlers and "ansible.builtin.reboot" in handlers
    doca = _tasks(ROLES / "infiniband" / "tasks" / "doca.yml")
    assert any(t.get("notify") == "DOCA changed" for t in doca)


IBSTAT = """CA '{ca}'
\tCA type: MT4129
\tNumber of ports: 1
\tPort 1:
\t\tState: {state}
\t\tPhysical state: LinkUp
\t\tRate: 400
\t\tLink layer: InfiniBand"""


@pytest.mark.slow
def test_ports_are_waited_for_while_the_fabric_initializes(bundle):
    with private_dir("ibstat") as root:
        counter = root / "calls"
        counter.write_text("0")
        # Initializing for the first two calls (opensm still sweeping), then Active
        slow = (f"n=$(cat {counter}); echo $((n+1)) > {counter}\n"
                f"if [ $n -lt 2 ]; then state=Initializing; else state=Active; fi\n"
                "printf \"CA 'mlx5_0'\\n\\tPort 1:\\n\\t\\tState: %s\\n\\t\\tPhysical state: LinkUp\\n\\t\\tLink layer: InfiniBand\\n\" \"$state\"")
        fake = _fake_bin(root, {"ibstat": slow})
        out = _run_cases(bundle, "ports.yml", "infiniband", "ports.yml", [
            {"infiniband_port_retries": 5, "infiniband_port_delay": 0},
        ], fake=fake)
        assert "...ignoring" not in out and counter.read_text().strip() == "3"
        never = root / "never"
        never.mkdir()
        fake2 = _fake_bin(never, {"ibstat": "cat <<'EOF'\n" + IBSTAT.format(ca="mlx5_0", state="Initializing") + "\nEOF"})
        out2 = _run_cases(bundle, "ports2.yml", "infiniband", "ports.yml", [
            {"infiniband_port_retries": 2, "infiniband_port_delay": 0},
        ], fake=fake2)
    assert re.search(r"after \d+ tries: CAs mlx5_0, ports \(state, physical, link layer\)\s+Initializing/LinkUp/InfiniBand", out2)
    assert "FAILED - RETRYING" in out2  # it waited before failing


@pytest.mark.slow
def test_oci_rdma_nics_need_oci_cn_auth(bundle):
    oci = sample_plan("oci")
    assert oci.fabric.rdma_ipv4_by == "oci-rdma-configure" and oci.fabric.nccl_env["NCCL_IB_GID_INDEX"] == "3"
    assert yaml.safe_load(render_ansible(oci)["group_vars/all.yml"])["infiniband_oci_rdma"] is True
    assert yaml.safe_load(render_ansible(sample_plan("azure"))["group_vars/all.yml"])["infiniband_oci_rdma"] is False
    if Path("/sbin/oci-rdma-configure").exists():
        pytest.skip("this machine has oci-cn-auth")
    # not ignored: the play must stop there, before it touches /etc/oci-hpc or any service
    out = _run_cases(bundle, "oci.yml", "infiniband", "oci.yml", [{"infiniband_hcas": ["mlx5_0"]}], ignore=False)
    assert "/sbin/oci-rdma-configure (oci-cn-auth) is missing on node0" in out
    assert "Set the RDMA network" not in out and recap(out)["failed"] == 1
    variables = (REPO / "templates" / "terraform" / "oci" / "variables.tf.j2").read_text()
    assert "Oracle Linux" not in variables  # the image the Terraform asks for must pass gpu_preflight


# ------------------------------------------------------------------ 9. EFA


def test_efa_installer_is_versioned_verified_and_its_plugin_checked():
    tasks = _tasks(ROLES / "efa" / "tasks" / "main.yml")
    text = (ROLES / "efa" / "tasks" / "main.yml").read_text()
    unpack = next(t for t in tasks if "ansible.builtin.unarchive" in t)["ansible.builtin.unarchive"]
    assert "{{ efa_installer_version }}" in unpack["creates"]  # a version bump unpacks afresh
    download = next(t for t in tasks if t["name"] == "Download the EFA installer")["ansible.builtin.get_url"]
    assert "efa_installer_sha256" in download["checksum"]
    assert "gpg --homedir" in text and "--verify aws-efa-installer.tar.gz.sig" in text
    assert "libnccl-net*.so*" in text
    assert get_fabric("efa", "aws", "p5.48xlarge").nccl_net is not None


ALL_REDUCE = """# nccl-tests
node0:1:1 [0] NCCL INFO {net_line}
node0:1:1 [0] NCCL INFO Channel 00/32 : 0 1 2 3 4 5 6 7
  1073741824     268435456     float     sum      -1   5000.0  214.75  375.81      0   5001.0  214.71  375.74      0
# Avg bus bandwidth    : 375.78"""


@pytest.mark.slow
def test_nccl_check_fails_when_nccl_falls_back_to_sockets(bundle):
    efa_net = get_fabric("efa", "aws", "p5.48xlarge").nccl_net
    with private_dir("net") as root:
        for name, line in (("ofi", "Using network AWS Libfabric"), ("socket", "Using network Socket"),
                           ("ib", "Using network IB")):
            d = root / name
            d.mkdir()
            _fake_tool_dir(d, {"all_reduce_perf": ALL_REDUCE.format(net_line=line)})
        out = _run_cases(bundle, "net.yml", "healthcheck", "nccl.yml", [
            {"healthcheck_nccl_tests_dir": f"{root}/ofi/fake-bin", "healthcheck_nccl_net": efa_net, "healthcheck_fabric": "efa"},
            {"healthcheck_nccl_tests_dir": f"{root}/socket/fake-bin", "healthcheck_nccl_net": efa_net, "healthcheck_fabric": "efa"},
            {"healthcheck_nccl_tests_dir": f"{root}/ib/fake-bin", "healthcheck_nccl_net": "IB", "healthcheck_fabric": "infiniband"},
        ], extra={"healthcheck_nccl_busbw_min_gbytes_per_s": None})
    assert "NCCL uses network AWS Libfabric" in out and "NCCL uses network IB" in out
    assert "NCCL logged network Socket; the efa fabric needs" in out
    assert out.count("...ignoring") == 1


# ------------------------------------------------------------------ 10, 11. reboot handler, site order


def test_manual_reboot_handler_is_notified_when_reboots_are_not_allowed(bundle):
    notify = bundle / "roles" / "nvidia_driver" / "tasks" / "_test_notify.yml"
    notify.write_text(yaml.safe_dump([{"name": "A driver package changed", "ansible.builtin.debug": {"msg": "x"},
                                       "changed_when": True, "notify": "NVIDIA driver changed"},
                                      {"name": "Flush", "ansible.builtin.meta": "flush_handlers"}]))
    try:
        (bundle / "reboot.yml").write_text(yaml.safe_dump([{"name": "t", "hosts": "gpu_nodes", "gather_facts": True,
            "vars": {**_preflight_ok(), "nvidia_driver_reboot_allowed": False},
            "tasks": [{"name": "notify", "ansible.builtin.include_role": {
                "name": "nvidia_driver", "tasks_from": "_test_notify.yml"}}]}]))
        result = playbook(bundle, "-i", "local-inventory.yml", "reboot.yml")
    finally:
        notify.unlink()
    assert result.returncode != 0
    assert "nvidia_driver_reboot_allowed is false: reboot the node, then run the playbook again" in result.stdout
    install = _tasks(ROLES / "nvidia_driver" / "tasks" / "install.yml")
    assert any(t.get("notify") == "NVIDIA driver changed" for t in install)


@pytest.mark.parametrize("cloud", CLOUDS)
def test_site_checks_the_host_before_anything_installs(cloud):
    site = yaml.safe_load(render_ansible(sample_plan(cloud))["site.yml"])
    assert site[0]["roles"][0] == {"role": "gpu_preflight", "tags": ["always"]}
    assert site[0]["roles"][1]["role"] == "node_baseline"
    storage = [i for i, p in enumerate(site) if any(r["role"] == "nvme_raid" for r in p.get("roles", []))]
    assert storage and storage[0] > 0


def test_storage_tag_alone_still_stops_on_an_unsupported_os(bundle):
    result = playbook(bundle, "-i", "local-inventory.yml", "site.yml", "--tags", "storage", "--check",
                      extra_vars={"gpu_preflight_supported_os": ["ubuntu-99.04"]})
    assert result.returncode != 0
    assert "the GPU roles support only ubuntu-99.04" in result.stdout
    assert "mdadm" not in result.stdout.split("the GPU roles support only")[1]
    assert recap(result.stdout)["changed"] == 0


# ------------------------------------------------------------------ 12. unattended upgrades, kernel, memlock


def test_node_baseline_turns_off_upgrades_holds_the_kernel_and_raises_memlock():
    text = (ROLES / "node_baseline" / "tasks" / "main.yml").read_text()
    assert 'APT::Periodic::Unattended-Upgrade "0"' in text and 'APT::Periodic::Update-Package-Lists "0"' in text
    assert "unattended-upgrades.service apt-daily.timer apt-daily-upgrade.timer" in text
    assert "* hard memlock unlimited" in text and "DefaultLimitMEMLOCK=infinity" in text
    patterns = yaml.safe_load((ROLES / "node_baseline" / "defaults" / "main.yml").read_text())["node_baseline_kernel_patterns"]
    assert "linux-image-{{ ansible_facts['kernel'] }}" in patterns
    assert {"linux-aws*", "linux-gcp*", "linux-azure*", "linux-oracle*", "linux-generic*"} <= set(patterns)
    efa = (ROLES / "efa" / "tasks" / "main.yml").read_text()
    assert "fuser /var/lib/dpkg/lock-frontend" in efa  # the installer waits for a running apt


# ------------------------------------------------------------------ 13. nccl.conf, Xid, DCGM, MTU, mkfs


def test_nccl_conf_is_left_to_the_image_where_the_image_owns_it():
    for cloud in CLOUDS:
        plan = sample_plan(cloud)
        gv = yaml.safe_load(render_ansible(plan)["group_vars/all.yml"])
        assert gv["nccl_conf_path"] == ("" if cloud == "azure" else "/etc/nccl.conf")
    task = next(t for t in _tasks(ROLES / "nccl" / "tasks" / "main.yml") if t["name"] == "Write the NCCL configuration file")
    assert task["when"] == "nccl_conf_path | length > 0"


XIDS = {
    "app": ["NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=python, Graphics Exception",
            "NVRM: Xid (PCI:0000:3b:00): 31, pid=4242, name=python, Ch 00000008, MMU Fault"],
    "hw": ["NVRM: Xid (PCI:0000:3b:00): 43, pid=4242, name=python, Ch 00000008",
           "NVRM: Xid (PCI:0000:86:00): 79, pid=0, GPU has fallen off the bus."],
}


@pytest.mark.slow
def test_application_xids_pass_hardware_xids_fail(bundle):
    with private_dir("xid") as root:
        outs = {}
        for name, lines in XIDS.items():
            d = root / name
            d.mkdir()
            fake = _fake_bin(d, {"journalctl": "cat <<'EOF'\n" + "\n".join(lines) + "\nEOF"})
            outs[name] = _run_cases(bundle, f"xid-{name}.yml", "healthcheck", "gpus.yml", [{}], fake=fake)
    assert "no hardware XID errors since boot; 2 application XID(s) ignored" in outs["app"]
    assert "1 hardware XID error(s) since boot (Xid 79)" in outs["hw"]


@pytest.mark.slow
def test_dcgm_is_installed_and_required(bundle):
    defaults = yaml.safe_load((ROLES / "nvidia_driver" / "defaults" / "main.yml").read_text())
    assert defaults["nvidia_driver_dcgm"] is True
    dcgm = _tasks(ROLES / "nvidia_driver" / "tasks" / "dcgm.yml")
    install = next(t for t in dcgm if t["name"].startswith("Install DCGM"))
    assert install["ansible.builtin.apt"]["name"][0] == \
        "datacenter-gpu-manager-4-cuda{{ nvidia_driver_dcgm_major }}={{ nvidia_driver_dcgm_version }}"
    assert dcgm[-1]["ansible.builtin.systemd_service"]["name"] == "nvidia-dcgm"
    if Path("/usr/bin/dcgmi").exists():
        pytest.skip("this machine has DCGM")
    out = _run_cases(bundle, "dcgm.yml", "healthcheck", "dcgm.yml", [{}, {"healthcheck_dcgm_required": False}])
    assert "/usr/bin/dcgmi is missing; dcgmi diag cannot run" in out
    assert out.count("...ignoring") == 1


@pytest.mark.slow
def test_gcp_mtu_check_needs_every_gpu_nic(bundle):
    lo_mtu = int(Path("/sys/class/net/lo/mtu").read_text())
    others = [p.name for p in Path("/sys/class/net").iterdir() if p.name != "lo"
              and int((p / "mtu").read_text()) < lo_mtu]
    if not others:
        pytest.skip("no interface with an MTU below lo's")
    low = others[0]
    out = _run_cases(bundle, "mtu.yml", "gcp_rdma", "main.yml", [
        {"gcp_rdma_mode": "checks-only", "gcp_rdma_mtu": lo_mtu, "gcp_rdma_gpu_nics": ["lo"], "gcp_rdma_gpu_nic_count": 1},
        {"gcp_rdma_mode": "checks-only", "gcp_rdma_mtu": lo_mtu, "gcp_rdma_gpu_nics": ["lo", low], "gcp_rdma_gpu_nic_count": 2},
        {"gcp_rdma_mode": "checks-only", "gcp_rdma_mtu": lo_mtu, "gcp_rdma_gpu_nics": ["lo"], "gcp_rdma_gpu_nic_count": 8},
    ])
    assert f"1 GPU NICs at MTU {lo_mtu} or more" in out
    assert f"below MTU {lo_mtu}: {low} " in out  # one NIC short fails, even with another passing
    assert "(expected 8)" in out
    assert out.count("...ignoring") == 2


def test_mkfs_skips_discard_and_sets_the_log_stripe_unit():
    build = (ROLES / "nvme_raid" / "tasks" / "build.yml").read_text()
    assert "['mkfs.xfs', '-K']" in build and "'-l', 'su=' ~ (nvme_raid_log_su_kib | int) ~ 'k'" in build
    assert yaml.safe_load((ROLES / "nvme_raid" / "defaults" / "main.yml").read_text())["nvme_raid_log_su_kib"] <= 256


# ------------------------------------------------------------------ training environment


def test_requirements_file_carries_the_catalog_pins_and_env_sh_activates_the_venv():
    from gpuprov.render.launch import render_launch

    env = load_data("software.yaml")["python_env"]
    plan = sample_plan("aws")
    plan = plan.model_copy(update={"software": get_software("hopper", "efa", True, gpu="h100-80gb", cloud="aws")})
    files = render_ansible(plan)
    lines = [ln for ln in files["requirements-train.txt"].splitlines() if ln and not ln.startswith("#")]
    assert lines == [f"--extra-index-url {env['index_url']}", *env["requirements"]]
    names = {r.split("==")[0].lower() for r in env["requirements"]}
    assert {"torch", "transformers", "peft", "bitsandbytes", "numpy", "pyyaml"} <= names
    assert all("==" in r for r in env["requirements"])
    assert "cu" + plan.software.cuda_version.replace(".", "") in env["index_url"]  # torch built for the plan's CUDA
    text = render_launch(plan)["env.sh"]
    assert f". {plan.software.python_env_path}/bin/activate" in text
    site = yaml.safe_load(files["site.yml"])
    assert {"role": "training_env", "tags": ["train"]} in next(p for p in site if p.get("name") == "GPU driver, fabric and NCCL")["roles"]


def _standin_wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel (the format pip installs), so the role runs without an index."""
    dist = f"{name}-{version}.dist-info"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    files = {f"{name}/__init__.py": f'__version__ = "{version}"\n',
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: gpuprov-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(path, "w") as archive:
        for rel, text in files.items():
            archive.writestr(rel, text)
        archive.writestr(f"{dist}/RECORD", "".join(f"{rel},,\n" for rel in files) + f"{dist}/RECORD,,\n")
    return path


@pytest.mark.slow
@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="no system python3")
def test_training_env_role_installs_exactly_the_bundle_requirements(bundle):
    with private_dir("venv") as root:
        wheels = root / "wheels"
        wheels.mkdir()
        _standin_wheel(wheels, "gpuprovstandin", "1.2.3")
        req = root / "requirements-train.txt"
        req.write_text(f"--no-index\n--find-links {wheels}\ngpuprovstandin==1.2.3\n")
        case = {"training_env_path": str(root / "venv"), "training_env_requirements_file": str(req),
                "training_env_cuda_version": "", "training_env_imports": ["gpuprovstandin"]}
        first = _run_cases(bundle, "venv.yml", "training_env", "main.yml", [case])
        assert "...ignoring" not in first and "training venv:" in first and '"gpuprovstandin": "1.2.3"' in first
        # venv and pip are installed here, so apt (and its cache refresh over the network) is not asked
        assert re.search(r"TASK \[training_env : Install Python's venv and pip\] \**\nskipping:", first), first
        again = _run_cases(bundle, "venv.yml", "training_env", "main.yml", [case])
        assert recap(again)["changed"] == 0
        assert (root / "venv" / "requirements-train.txt").read_text() == req.read_text()


# ------------------------------------------------------------------ multi-node fabric check


def test_multinode_threshold_comes_from_the_fabric_catalog():
    rule = load_data("fabrics.yaml")["multinode_allreduce"]
    for cloud, instance in (("aws", "p5.48xlarge"), ("azure", "Standard_ND96isr_H100_v5"), ("gcp", "a3-megagpu-8g")):
        fabric = get_fabric(get_fabric_name(cloud, instance), cloud, instance)
        minimum, source = fabric_allreduce_threshold(fabric, 8, 2)
        assert minimum == round(fabric.gbps_per_gpu * 8 / 8 * rule["fraction_of_line_rate"], 1)
        assert "nccl-tests" in source
    assert fabric_allreduce_threshold(fabric, 8, 1)[0] is None
    eth = get_fabric("ethernet", "aws", "g5.48xlarge")
    assert fabric_allreduce_threshold(eth, 8, 4)[0] is None


def get_fabric_name(cloud: str, instance: str) -> str:
    from gpuprov.catalog.fabrics import fabric_name_for

    return fabric_name_for(cloud, instance)


@pytest.mark.slow
def test_multinode_allreduce_runs_across_nodes_and_fails_below_the_threshold():
    """Two inventory nodes (both this machine) run the role's probe at once: a real two-node
    torchrun rendezvous (gloo on CPU), rank 0 on the first node, the bandwidth checked there."""
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.skip("torch not installed")
    venv = Path(sys.executable).parent.parent
    with private_dir("multinode") as root:
        write_files(root, render_ansible(sample_plan("aws")))
        hosts = {h: {"ansible_connection": "local", "ansible_python_interpreter": sys.executable} for h in ("node0", "node1")}
        (root / "two.yml").write_text(json.dumps({"all": {"children": {"gpu_nodes": {"hosts": hosts}}}}))
        # on one machine both "nodes" write the probe to /opt/gpuprov: point it at a private copy
        (root / "play.yml").write_text(yaml.safe_dump([{"name": "t", "hosts": "gpu_nodes", "gather_facts": True,
            "vars": {**_preflight_ok(), "healthcheck_venv": str(venv), "healthcheck_fabric_backend": "gloo",
                     "healthcheck_expected_gpus": 1, "healthcheck_fabric_bytes": 1 << 20, "healthcheck_fabric_iters": 3,
                     "healthcheck_fabric_master": "127.0.0.1", "healthcheck_fabric_port": free_port(),
                     "healthcheck_fabric_timeout": 300, "healthcheck_nccl_net": "IB",
                     "healthcheck_fabric_busbw_min_gbytes_per_s": 1.0e6,
                     "healthcheck_fabric_probe": str(root / "probe" / "allreduce_bench.py")},
            "tasks": [{"name": "probe", "ansible.builtin.include_role": {"name": "healthcheck", "tasks_from": "allreduce.yml"}}]}]))
        result = playbook(root, "-i", "two.yml", "play.yml", timeout=900)
    out = result.stdout
    assert "node 0 took part" in out and "node 1 took part" in out, out[-4000:]
    found = re.search(r"across 2 ranks \(2 nodes\) measured ([0-9.]+) GB/s bus bandwidth \(minimum 1000000.0 GB/s", out)
    assert found and float(found.group(1)) > 0, out[-4000:]
    assert result.returncode != 0  # below the threshold: the play fails with the measured value


APT_POLICY = """nvidia-fabricmanager-570:
  Installed: (none)
  Candidate: 570.172.08-0ubuntu0.22.04.1
  Version table:
     570.181.01-1 500
        500 file:/srv/cuda ./ Packages
     570.172.08-1 500
        500 file:/srv/cuda ./ Packages
 *** 570.172.08-0ubuntu0.22.04.1 900
        900 file:/srv/ubuntu ./ Packages
        100 /var/lib/dpkg/status
"""




# ------------------------------------------------------------------ issue 29: keep what the image ships


def _fm():
    sys.path.insert(0, str(ROLES / "nvidia_driver" / "files"))
    try:
        import fabric_manager_plan
    finally:
        sys.path.pop(0)
    return fabric_manager_plan


def test_fabric_manager_follows_the_installed_drivers_origin_and_naming():
    fm = _fm()
    # Azure ubuntu-hpc: CUDA-repository nvidia-open 580 (no -server kernel-common): the unsuffixed
    # CUDA-repository build; NSCQ under whichever name the repository carries (uncertain: both)
    for nscq in ("libnvidia-nscq", "libnvidia-nscq-580"):
        got = fm.decide("580.126.16", "580", {"nvidia-open": "580.126.16-1"}, {
            "nvidia-fabricmanager": [("580.126.16-1", "NVIDIA"), ("580.173.02-1", "NVIDIA")],
            nscq: [("580.126.16-1", "NVIDIA")]})
        assert got == {"flavour": "cuda-repo", "keep": [],
                       "install": ["nvidia-fabricmanager=580.126.16-1", f"{nscq}=580.126.16-1"], "missing": []}
    # GCP: Ubuntu's -server driver: Ubuntu's build although the CUDA repository's -1 sorts higher
    got = fm.decide("570.172.08", "570", {"nvidia-kernel-common-570-server": "570.172.08-0ubuntu0.22.04.1"}, {
        "nvidia-fabricmanager-570": [("570.172.08-1", "NVIDIA"), ("570.172.08-0ubuntu0.22.04.1", "Ubuntu")],
        "libnvidia-nscq-570": [("570.172.08-1", "NVIDIA"), ("570.172.08-0ubuntu0.22.04.1", "Ubuntu")]})
    assert got["install"] == ["nvidia-fabricmanager-570=570.172.08-0ubuntu0.22.04.1",
                              "libnvidia-nscq-570=570.172.08-0ubuntu0.22.04.1"]
    # the image's own fabric manager at the loaded version is kept although -updates moved past it
    got = fm.decide("570.172.08", "570", {"nvidia-kernel-common-570-server": "570.172.08-0ubuntu0.22.04.1",
                                          "nvidia-fabricmanager-570": "570.172.08-0ubuntu0.22.04.1",
                                          "libnvidia-nscq-570": "570.172.08-0ubuntu0.22.04.1"},
                    {"nvidia-fabricmanager-570": [("570.195.03-0ubuntu0.22.04.1", "Ubuntu")]})
    assert got["keep"] == ["nvidia-fabricmanager-570", "libnvidia-nscq-570"] and got["install"] == []
    # no build of the loaded version from the driver's repository: named, never a mixed flavour
    got = fm.decide("570.172.08", "570", {"nvidia-kernel-common-570-server": "570.172.08-0ubuntu0.22.04.1"},
                    {"nvidia-fabricmanager-570": [("570.172.08-1", "NVIDIA")]})
    assert got["missing"] == ["fabric manager", "nscq"]


def test_fabric_manager_builds_compare_in_debian_order_not_string_order():
    fm = _fm()
    # string order puts -9 after -10; Debian order does not
    got = fm.decide("580.65.06", "580", {}, {"nvidia-fabricmanager": [("580.65.06-9", "NVIDIA"), ("580.65.06-10", "NVIDIA")],
                                             "libnvidia-nscq": [("580.65.06-10", "NVIDIA")]})
    assert got["install"][0] == "nvidia-fabricmanager=580.65.06-10"
    assert fm.compare("580.65.06-10", "580.65.06-9") > 0 and fm.compare("1:4.2.3-1", "4.9") > 0


@pytest.mark.slow
def test_efa_installer_runs_only_where_older(bundle):
    with private_dir("efa") as root:
        cases = []
        for found in ("", "1.43.2", "1.43.3", "1.50.0", "1.9.1"):
            path = root / f"efa-{found or 'none'}"
            if found:
                path.write_text(f"# EFA installer version: {found}\n# Debug packages installed: no\n")
            cases.append({"efa_installer_version": "1.43.2", "efa_installed_packages_file": str(path)})
        _run_cases(bundle, "efa.yml", "efa", "decide.yml", cases, report="efa_install | bool")
    # none: install; same: keep; newer (DLAMI 1.43.3, 1.50.0): keep, never downgraded; 1.9.1 < 1.43.2
    assert [_reports(bundle, "efa.yml")[i] for i in range(5)] == [True, False, False, False, True]


@pytest.mark.slow
def test_dcgm_follows_the_drivers_cuda_major_and_keeps_the_images(bundle):
    with private_dir("dcgm") as root:
        (root / "none").mkdir(); (root / "have").mkdir()
        none = _fake_bin(root / "none", {"dpkg-query": "exit 1"})
        have = _fake_bin(root / "have", {"dpkg-query": "echo 'datacenter-gpu-manager-4-cuda13 1:4.5.2-1 installed'"})
        cases = [{"nvidia_driver_effective_branch": "580", "nvidia_driver_cuda_repo_ready": False},
                 {"nvidia_driver_effective_branch": "570", "nvidia_driver_cuda_repo_ready": False}]
        _run_cases(bundle, "dcgm-none.yml", "nvidia_driver", "dcgm.yml", cases, fake=none,
                   report="[nvidia_driver_dcgm_major, nvidia_driver_dcgm_found]")
        got = _reports(bundle, "dcgm-none.yml")
        assert got[0] == [13, []] and got[1] == [12, []]  # driver 580 -> cuda13, whatever CUDA the plan trains with
        _run_cases(bundle, "dcgm-have.yml", "nvidia_driver", "dcgm.yml", cases[:1], fake=have,
                   report="nvidia_driver_dcgm_found")
        assert _reports(bundle, "dcgm-have.yml")[0] == ["datacenter-gpu-manager-4-cuda13=1:4.5.2-1"]  # kept
    install = next(t for t in _tasks(ROLES / "nvidia_driver" / "tasks" / "dcgm.yml") if t["name"].startswith("Install DCGM"))
    assert all("=" in name for name in install["ansible.builtin.apt"]["name"])  # pinned
    assert "not nvidia_driver_dcgm_found" in install["when"]


def test_nccl_tests_use_the_images_build_or_a_directory_the_project_owns():
    defaults = yaml.safe_load((ROLES / "nccl" / "defaults" / "main.yml").read_text())
    assert defaults["nccl_tests_dir"].startswith("/opt/gpuprov/")
    tasks = _tasks(ROLES / "nccl" / "tasks" / "main.yml")
    for task in tasks:
        if "ansible.builtin.git" in task or task["name"].startswith("Build nccl-tests"):
            assert "not nccl_tests_use_image" in task["when"], task["name"]
    group_vars = yaml.safe_load(render_ansible(_with_profile(sample_plan("azure")))["group_vars/all.yml"])
    assert group_vars["nccl_tests_image_dir"] == "/opt/nccl-tests"  # azhpc-images' MPI build


IBSTAT_MIXED = """CA 'mlx5_0'
\tPort 1:
\t\tState: Active
\t\tPhysical state: LinkUp
\t\tLink layer: InfiniBand
CA 'mlx5_1'
\tPort 1:
\t\tState: Down
\t\tPhysical state: Polling
\t\tLink layer: InfiniBand
CA 'mlx5_2'
\tPort 1:
\t\tState: Down
\t\tPhysical state: Disabled
\t\tLink layer: Ethernet"""


@pytest.mark.slow
def test_onprem_ports_need_only_the_cabled_infiniband_ports(bundle):
    with private_dir("ibmixed") as root:
        fake = _fake_bin(root, {"ibstat": f"cat <<'EOF'\n{IBSTAT_MIXED}\nEOF"})
        out = _run_cases(bundle, "ibmixed.yml", "infiniband", "ports.yml", [
            {"infiniband_hcas": [], "infiniband_port_retries": 0, "infiniband_port_delay": 0},
            {"infiniband_hcas": ["mlx5_0", "mlx5_1"], "infiniband_port_retries": 0, "infiniband_port_delay": 0},
        ], fake=fake)
    assert out.count("...ignoring") == 1  # the named mlx5_1 is down: only that case fails
    assert "Down/Polling/InfiniBand" in out


def test_findings_5_8_9_10_12_in_the_roles():
    oci = (ROLES / "infiniband" / "tasks" / "oci.yml").read_text()
    assert "modify_arp=true" in oci and "override_netconfig_netmask=" in oci and "[subnet]" in oci
    doca = [t["name"] for t in _tasks(ROLES / "infiniband" / "tasks" / "doca.yml")]
    assert doca.index("Install kernel headers for the running kernel") < doca.index("Install DOCA-OFED")
    assert doca.index("Remove an MLNX_OFED/DOCA too old to upgrade") < doca.index("Install DOCA-OFED")
    ib = yaml.safe_load((ROLES / "infiniband" / "defaults" / "main.yml").read_text())
    assert ib["infiniband_doca_arch"]["aarch64"] == "arm64-sbsa" and "infiniband_doca_arch[" in ib["infiniband_doca_repo_url"]
    for name in ("gib", "tcpxo"):
        tasks = _tasks(ROLES / "gcp_rdma" / "tasks" / f"{name}.yml")
        ld = [t for t in tasks if "/etc/ld.so.conf.d/" in json.dumps(t)]
        assert ld and all(t["ansible.builtin.file"]["state"] == "absent" for t in ld)  # only removed
        assert any("LD_LIBRARY_PATH" in json.dumps(t) for t in tasks)
    drv = yaml.safe_load((ROLES / "nvidia_driver" / "defaults" / "main.yml").read_text())
    assert any(p.startswith("linux-modules-nvidia-") for p in drv["nvidia_driver_packages_signed"])
    assert "mokutil --sb-state" in (ROLES / "nvidia_driver" / "tasks" / "install.yml").read_text()
    assert "mkfs.xfs -K " in (ROLES / "nvme_raid" / "templates" / "nvme-raid-rebuild.sh.j2").read_text()
    assert "unattended_upgrades role" not in (ROLES / "efa" / "tasks" / "main.yml").read_text()


def _with_profile(plan):
    from gpuprov.catalog.images import image_profile

    profile = image_profile(plan.instance.cloud, plan.instance.name)
    return plan.model_copy(update={"software": plan.software.model_copy(update={"image_profile": profile})})


def test_every_image_profile_is_sourced_and_the_plan_names_its_own():
    from gpuprov.catalog import images

    profiles = images.profiles()
    assert {"aws", "gcp", "azure", "oci", "onprem"} == {p["cloud"] for p in profiles.values()}
    for name, entry in profiles.items():
        for part in images.COMPONENTS:
            if entry[part] is not None:
                assert entry[part]["source"] and re.fullmatch(r"\d{4}-\d\d-\d\d", entry[part]["date"]), (name, part)
    assert images.profile_for("gcp", "a3-ultragpu-8g") == "gcp-a3-ultra-ubuntu2204"
    assert images.profile_for("gcp", "a4-highgpu-8g") == "gcp-a4-ubuntu2204"
    assert images.dcgm_cuda_major(580) == "13" and images.dcgm_cuda_major(570) == "12"
    for cloud in ("aws", "azure", "gcp", "oci", "onprem"):
        plan = _with_profile(sample_plan(cloud))
        group_vars = yaml.safe_load(render_ansible(plan)["group_vars/all.yml"])
        assert group_vars["gpuprov_image_profile"] == plan.software.image_profile.name
        assert profiles[plan.software.image_profile.name]["cloud"] == cloud
