"""Azure and OCI quota names in the catalog (issue 27): validate names the quota to request for the
plan's type and purchase option, with the command that requests or shows it. Offline that names the quota
without reading its limit, so validate reports the row skipped and `--strict --offline` fails on it
(issue 40)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gpuprov.preflight import offline_checks
from plan_fixtures import sample_plan, with_bringup

REPO = Path(__file__).resolve().parent.parent


def _quota(cloud: str, instance: str, tmp_path: Path, tfvars: str = ""):
    plan = sample_plan(cloud, nodes=2)
    plan = with_bringup(plan.model_copy(update={
        "instance": plan.instance.model_copy(update={"name": instance}),
        "cluster": plan.cluster.model_copy(update={"instance_type": instance})}), instance)
    (tmp_path / "terraform").mkdir(exist_ok=True)
    if tfvars:
        (tmp_path / "terraform" / "terraform.tfvars").write_text(tfvars)
    return next(c for c in offline_checks(plan, tmp_path) if c.name == "quota"), plan


@pytest.mark.parametrize("instance, code, need", [
    ("Standard_ND96isr_H100_v5", "standardNDSH100v5Family", "192 vCPUs"),
    ("Standard_ND96amsr_A100_v4", "standardNDAMSv4_A100Family", "192 vCPUs"),
    ("Standard_ND96isr_H200_v5", "standardNDISRH200V5Family", "192 vCPUs"),
])
def test_azure_names_the_vm_family_vcpu_quota(instance, code, need, tmp_path):
    quota, plan = _quota("azure", instance, tmp_path)
    assert quota.status == "ok", quota
    assert f"{need} of {code}" in quota.detail and plan.instance.region in quota.detail
    assert f"--resource-name {code}" in quota.fix and "value=192" in quota.fix and "dedicated" in quota.fix


def test_azure_spot_draws_on_the_regional_spot_quota(tmp_path):
    quota, _ = _quota("azure", "Standard_ND96isr_H100_v5", tmp_path, 'purchase_option = "spot"\n')
    assert "of lowPriorityCores" in quota.detail and "--resource-type lowPriority" in quota.fix


@pytest.mark.parametrize("instance, code", [
    ("BM.GPU.H100.8", "gpu-h100-count"), ("BM.GPU.H200.8", "gpu-h200-count"), ("BM.GPU.A100-v2.8", "gpu-a100-v2-count"),
])
def test_oci_names_the_gpu_service_limit(instance, code, tmp_path):
    quota, _ = _quota("oci", instance, tmp_path)
    assert quota.status == "ok" and f"16 GPUs of {code}" in quota.detail, quota
    assert f"--limit-name {code}" in quota.fix


@pytest.mark.parametrize("cloud, instance", [
    ("aws", "p5.48xlarge"), ("gcp", "a3-megagpu-8g"), ("azure", "Standard_ND96isr_H100_v5"), ("oci", "BM.GPU.H100.8"),
])
def test_every_cloud_fix_comes_from_the_catalog_and_names_code_need_and_region(cloud, instance, tmp_path):
    """One home for the request command: the catalog's `fix`, filled the same way on every cloud."""
    from gpuprov.catalog import bringup as cat
    quota, plan = _quota(cloud, instance, tmp_path)
    entry = cat.quota(cloud)
    head = entry["fix"].split("{", 1)[0].split()
    assert quota.status == "ok", quota
    assert shlex.split(quota.fix)[:len(head)] == head, quota.fix
    need = quota.detail.split()[1]
    assert need in quota.fix and quota.detail.split(" of ")[1].split()[0] in quota.fix
    if cloud != "oci":  # OCI's limit is per availability domain, named as $AD
        assert plan.instance.region in quota.fix


def _gpuprov(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("cloud", ["azure", "oci", "gcp"])
def test_strict_offline_validate_of_the_default_bundle(cloud, tmp_path):
    """--strict --offline never says ok for what it did not check: the live checks (offerings,
    reservation, quota, subnet routes) are reported skipped, which fails strict. The default GCP
    H200 plan buys flex-start: its bundle pins the provider line that sends FLEX_START (ok)."""
    root = tmp_path / "d"
    assert _gpuprov("generate", "--model", "70b", "--cloud", cloud, "-o", str(root)).returncode == 0
    plain = _gpuprov("validate", str(root))
    assert plain.returncode == 0, plain.stdout + plain.stderr
    strict = _gpuprov("validate", str(root), "--strict", "--offline", "--json")
    report = json.loads(strict.stdout)
    # the quota rule names what to request but reads no limit offline: skipped, like the live checks
    assert strict.returncode == 1 and report["unchecked"] == ["quota", "live checks"], report["unchecked"]
    live = next(c for c in report["checks"] if c["name"] == "live checks")
    assert live["detail"] == "--offline: offerings, reservation, quota and subnet routes are unchecked"
    assert "--strict: unchecked: quota, live checks" in strict.stderr
    provider = [c for c in report["checks"] if c["name"] == "provider support"]
    assert all(c["status"] == "ok" for c in provider), provider
