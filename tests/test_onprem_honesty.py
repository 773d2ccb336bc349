"""On-prem honesty: host facts nobody stated read "unknown", never pass; the time model says which
fabric it assumed; plan tries CPU offload when nothing else fits the user's GPUs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True, timeout=180)


def hosts_file(tmp_path: Path, rows: list[str]) -> str:
    path = tmp_path / "hosts.yaml"
    path.write_text("".join(f"- {{{r}}}\n" for r in rows))
    return str(path)


GPU_ONLY = [f"name: gpu{i}, address: 10.0.0.{i + 1}, gpu: a100-80gb, gpus: 8" for i in range(2)]


def test_gpu_only_hosts_leave_every_other_fact_unknown(tmp_path: Path):
    hosts = hosts_file(tmp_path, GPU_ONLY)
    r = run("plan", "--model", "70b", "--task", "lora", "--hosts", hosts, "--gpus", "16", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert set(p["instance"]["unknown"]) >= {"ram", "cores", "nvme", "fabric"}
    unknown = [c for c in p["host"]["checks"] if not c["known"]]
    assert len(unknown) == len(p["host"]["checks"])  # nothing about these hosts was stated but the GPUs
    assert not any(c["ok"] for c in unknown) and all("hosts probe" in c["actual"] for c in unknown)
    assert p["host"]["bill_of_materials"] is None and p["storage"]["devices"] == 0  # 0: the role takes what it finds
    text = run("plan", "--model", "70b", "--task", "lora", "--hosts", hosts, "--gpus", "16").stdout
    checklist = text.split("Host checklist")[1].split("\n\n")[0]
    assert "[ok]" not in checklist and checklist.count("[unknown]") == len(unknown)
    assert "assumed: the hosts file states no fabric" in text and "The time model assumed" in text


def test_topology_draws_no_invented_host_facts(tmp_path: Path):
    out = tmp_path / "b"
    r = run("generate", "--model", "70b", "--task", "lora", "--hosts", hosts_file(tmp_path, GPU_ONLY), "--gpus", "16",
            "-o", str(out))
    assert r.returncode == 0, r.stderr
    svg = (out / "topology.svg").read_text()
    assert "RAM unknown" in svg and "NICs unknown" in svg and "NVMe unknown" in svg
    assert svg.count('fill="#f5a623"') <= 1  # no NIC boxes drawn (at most the legend's swatch)


def test_stated_facts_are_checked(tmp_path: Path):
    rows = [f"name: gpu{i}, address: 10.0.0.{i + 1}, gpu: a100-80gb, gpus: 8, ram_gib: 2048, cores: 64, "
            "nvme_count: 4, nvme_gb_each: 3840, fabric: infiniband, nic_gbps: 1600" for i in range(2)]
    r = run("plan", "--model", "70b", "--task", "lora", "--hosts", hosts_file(tmp_path, rows), "--gpus", "16", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["instance"]["unknown"] == ["pcie"]  # the one fact a hosts file cannot state
    ram = next(c for c in p["host"]["checks"] if c["rule"].startswith("host RAM"))
    assert ram["known"] and ram["ok"] and "2,048 GiB" in ram["actual"]
    assert p["storage"]["devices"] == 4


def test_nothing_fits_without_offload_so_plan_offloads(tmp_path: Path):
    hosts = hosts_file(tmp_path, ["name: box0, address: 10.0.0.1, gpu: rtx-4090-24gb, gpus: 1",
                                  "name: box1, address: 10.0.0.2, gpu: rtx-4090-24gb, gpus: 1"])
    r = run("plan", "--model", "70b", "--task", "qlora", "--hosts", hosts, "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["cluster"]["offload"] in ("optimizer", "full") and p["spec"]["offload"] == p["cluster"]["offload"]
    assert any("without CPU offload" in n for n in p["notes"])
    # the user's explicit choice is kept: no offload means nothing fits, one line, exit 2
    refused = run("plan", "--model", "70b", "--task", "qlora", "--hosts", hosts, "--offload", "none")
    assert refused.returncode == 2 and refused.stderr.startswith("gpuprov: error: nothing fits")


def _bundle(tmp_path: Path, rows: list[str]) -> tuple[dict, str, str]:
    hosts = hosts_file(tmp_path, rows)
    out = tmp_path / "infra"
    r = run("generate", "--model", "70b", "--task", "lora", "--hosts", hosts, "--gpus", "16", "--shared-nfs",
            "10.0.0.9:/export", "-o", str(out))
    assert r.returncode == 0, r.stderr
    plan = json.loads((out / "plan.json").read_text())
    return plan, (out / "ansible" / "group_vars" / "all.yml").read_text(), (out / "ansible" / "site.yml").read_text()


def test_an_unknown_fabric_renders_no_infiniband_and_no_opensm(tmp_path: Path):
    """The hosts file states no fabric: the on-prem target records it unknown in the Plan; the bundle
    installs no RDMA stack and starts no subnet manager, and the play says how to learn the fabric."""
    from ruamel.yaml import YAML

    plan, group_vars, site = _bundle(tmp_path, GPU_ONLY)
    assert plan["fabric"]["probe"].startswith("unknown: run `gpuprov hosts probe")
    assert plan["fabric"]["subnet_manager"] == "none" and plan["provisioning"]["fabric_role"] is None
    gv = YAML(typ="safe").load(group_vars)
    assert "infiniband_subnet_manager" not in gv and gv["gpuprov_fabric_probe"] == plan["fabric"]["probe"]
    assert gv["healthcheck_nccl_net"] == ""  # no transport demanded of a fabric nobody named
    plays = YAML(typ="safe").load(site)
    roles = [r["role"] if isinstance(r, dict) else r for p in plays for r in p.get("roles", [])]
    assert "infiniband" not in roles
    skip = [t for p in plays for t in p.get("tasks", []) if "ansible.builtin.debug" in t]
    assert skip and "hosts probe" in skip[0]["ansible.builtin.debug"]["msg"]


def test_a_stated_infiniband_fabric_still_gets_its_role_and_subnet_manager(tmp_path: Path):
    rows = [r + ", fabric: infiniband, nic_gbps: 3200" for r in GPU_ONLY]
    plan, group_vars, _site = _bundle(tmp_path, rows)
    assert plan["fabric"]["probe"] is None and plan["provisioning"]["fabric_role"] == "infiniband"
    assert "infiniband_subnet_manager: \"opensm\"" in group_vars


def test_on_prem_roles_may_not_reboot_the_sites_machines(tmp_path: Path):
    """A role needing a reboot on the site's hosts stops and says so (the owner reboots); cloud nodes
    the bundle created may be rebooted. The target decides, the Plan records, group_vars carry it."""
    from ruamel.yaml import YAML

    rows = [r + ", fabric: infiniband, nic_gbps: 3200" for r in GPU_ONLY]
    plan, group_vars, _site = _bundle(tmp_path, rows)
    gv = YAML(typ="safe").load(group_vars)
    assert plan["provisioning"]["reboot_allowed"] is False
    assert gv["infiniband_reboot_allowed"] is False and gv["nvidia_driver_reboot_allowed"] is False
    cloud = run("plan", "--model", "70b", "--task", "lora", "--cloud", "aws", "--json")
    assert json.loads(cloud.stdout)["provisioning"]["reboot_allowed"] is True


NAMES_ONLY = [f"name: gpu{i}, address: 10.0.0.{i + 1}" for i in range(2)]


def test_hosts_stating_nothing_get_no_template_host_facts_or_fabric_demands(tmp_path: Path):
    """Hosts listed with names only (examples/7b-full-onprem): the server template stands for the
    GPUs the spec names, never for the hosts' RAM, NVMe or fabric: nothing reads ok, no NVMe count,
    no InfiniBand check, no subnet manager, no bus-bandwidth floor for a fabric nobody named."""
    from ruamel.yaml import YAML

    out = tmp_path / "infra"
    r = run("generate", "--model", "7b", "--gpu", "h100-80gb", "--max-nodes", "2", "--gpus", "16",
            "--hosts", hosts_file(tmp_path, NAMES_ONLY), "--shared-nfs", "10.0.0.9:/export", "-o", str(out))
    assert r.returncode == 0, r.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert plan["cluster"]["nodes"] == 2
    assert set(plan["instance"]["unknown"]) >= {"ram", "cores", "nvme", "fabric"}
    assert not any(c["ok"] for c in plan["host"]["checks"]) and plan["storage"]["devices"] == 0
    gv = YAML(typ="safe").load((out / "ansible" / "group_vars" / "all.yml").read_text())
    assert gv["healthcheck_fabric"] == "unknown" and gv["healthcheck_fabric_busbw_min_gbytes_per_s"] is None
    assert "infiniband_subnet_manager" not in gv and gv.get("nvme_raid_expected_devices", 0) == 0
    assert plan["health"]["fabric_allreduce_busbw_gbytes_per_s"] is None
    assert "opensm" not in (out / "ansible" / "site.yml").read_text()


def test_generate_offers_no_up_for_a_bundle_validate_fails(tmp_path: Path):
    """Two hosts, no shared filesystem named: generate says validate fails on it, and its next: line
    is not `validate && up`."""
    rows = [r + ", gpu: a100-80gb, gpus: 8" for r in NAMES_ONLY]
    out = tmp_path / "infra"
    r = run("generate", "--model", "70b", "--task", "lora", "--hosts", hosts_file(tmp_path, rows), "--gpus", "16",
            "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "fix: generate again with --shared-nfs" in r.stderr
    nxt = [ln for ln in r.stderr.splitlines() if ln.startswith("next:")]
    assert len(nxt) == 1 and "gpuprov up" not in nxt[0]
    assert run("validate", str(out)).returncode != 0  # what generate said
