"""`validate --offline` never says ok for what it did not check (issue 40, item 8): the quota rule
names the quota to request but reads no limit, and a subnet the user names has routes only a live
check reads. Offline each is a skipped row; with --strict each fails the run (exit 1) and the error
line names it. With the CLI answering, the live rows check them and the rows stay as they were."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuprov.cli import cli as main
from gpuprov.commands import gitops
from gpuprov.preflight import preflight
from plan_fixtures import sample_plan, with_bringup
from test_preflight import Recorded


@pytest.fixture(autouse=True)
def _no_tools(monkeypatch):
    """Only the bundle's own check and the pre-flight: the Terraform and Ansible checks have their tests."""
    monkeypatch.setattr(gitops, "CHECKS", tuple(c for c in gitops.CHECKS if c[0] == "plan fits"))


def _generate(tmp_path: Path, cloud: str, tfvars: str = "") -> Path:
    root = tmp_path / cloud
    result = CliRunner().invoke(main, ["generate", "--model", "8b", "--task", "lora", "--cloud", cloud, "-o", str(root)])
    assert result.exit_code == 0, result.output
    if tfvars:
        with open(root / "terraform" / "terraform.tfvars", "a") as f:
            f.write(tfvars)
    return root


def _validate(root: Path, *flags: str) -> tuple[int, dict, str]:
    result = CliRunner().invoke(main, ["validate", str(root), "--offline", "--json", *flags])
    return result.exit_code, json.loads(result.stdout), result.stderr


def _row(report: dict, name: str) -> dict:
    return next(c for c in report["checks"] if c["name"] == name)


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure", "oci"])
def test_offline_quota_is_skipped_and_strict_fails_naming_it(cloud, tmp_path):
    root = _generate(tmp_path, cloud)
    code, report, _ = _validate(root)
    quota = _row(report, "quota")
    assert quota["status"] == "skip" and quota["detail"].endswith("unchecked offline"), quota
    assert quota["fix"]  # still names the request command
    assert code == 0 and report["exit"] == 0 and "quota" in report["unchecked"]
    code, report, err = _validate(root, "--strict")
    assert code == 1 and report["exit"] == 1 and report["failed"] == len(report["unchecked"])
    assert err.count("\n") == 1 and "--strict: unchecked: " in err
    assert {"quota", "live checks"} <= set(err.split("unchecked: ", 1)[1].rstrip(")\n").split(", "))


@pytest.mark.parametrize("cloud, tfvars", [
    ("aws", 'subnet_id = "subnet-0123456789abcdef0"\navailability_zone = "us-east-1d"\n'),
    ("oci", 'subnet_id = "ocid1.subnet.oc1.iad.aaaaexample"\nbastion_host = "ubuntu@203.0.113.10"\n'),
])
def test_a_named_subnet_offline_is_an_unchecked_row_and_strict_fails(cloud, tfvars, tmp_path):
    root = _generate(tmp_path, cloud, tfvars)
    code, report, _ = _validate(root)
    routes = _row(report, "subnet routes")
    assert routes["status"] == "skip" and "unchecked offline" in routes["detail"], routes
    assert tfvars.split('"')[1] in routes["detail"] and code == 0
    code, report, err = _validate(root, "--strict")
    assert code == 1 and "subnet routes" in report["unchecked"] and "subnet routes" in err
    # without a subnet of the user's the bundle brings its network: no such row
    _, plain, _ = _validate(_generate(tmp_path / "own", cloud))
    assert "subnet routes" not in {c["name"] for c in plain["checks"]}


def _aws_plan():
    plan = sample_plan("aws", nodes=2)
    plan = plan.model_copy(update={"instance": plan.instance.model_copy(update={"name": "p5en.48xlarge"}),
                                   "cluster": plan.cluster.model_copy(update={"instance_type": "p5en.48xlarge"})})
    return with_bringup(plan, "p5en.48xlarge")


def test_rows_the_live_checks_ran_stay_as_they_were(tmp_path):
    """Signed in, the live quota and subnet rows check what the offline rows only name."""
    (tmp_path / "terraform").mkdir()
    (tmp_path / "terraform" / "terraform.tfvars").write_text(
        'subnet_id = "subnet-0123456789abcdef0"\navailability_zone = "us-east-1d"\n')
    rows = {c.name: c for c in preflight(_aws_plan(), tmp_path, live=True, run=Recorded())}
    assert rows["quota (live)"].status in ("ok", "fail") and rows["quota"].status == "ok", rows["quota"]
    assert rows["subnet (live)"].status == "ok" and "subnet routes" not in rows
    offline = {c.name: c for c in preflight(_aws_plan(), tmp_path, live=False)}
    assert offline["quota"].status == "skip" and offline["subnet routes"].status == "skip"
