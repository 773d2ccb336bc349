"""A reservation the user holds fixes the zone and region (issue 27, finding 5): looked up with the
cloud's CLI when it is signed in (answers recorded in tests/data/cli/), stated with --zone otherwise;
the zone reaches the Terraform defaults, and validate checks it against the reservation live and
says it is unchecked offline."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpuprov.errors import GpuprovError
from gpuprov.preflight import live_checks, locate_reservation, offline_checks
from gpuprov.spec import TrainingSpec
from test_preflight import Recorded

REPO = Path(__file__).resolve().parent.parent
AWS_HELD = dict(model="llama-3.1-8b", task="lora", cloud="aws", capacity_reservation_id="cr-0123456789abcdef0")
GCP_HELD = dict(model="llama-3.1-8b", task="lora", cloud="gcp", reservation="a3-pool")


def _absent(argv: list[str]) -> tuple[int, str]:
    return 127, ""  # the CLI is not installed (or not signed in: every call fails alike)


@pytest.mark.parametrize("given, zone, region, asked", [
    (AWS_HELD, "us-east-1d", "us-east-1", ["aws", "ec2", "describe-capacity-reservations"]),
    (GCP_HELD, "us-central1-a", "us-central1", ["gcloud", "compute", "reservations", "list"]),
])
def test_the_reservation_gives_zone_and_region(given, zone, region, asked):
    run = Recorded()
    spec = locate_reservation(TrainingSpec(**given), run)
    assert (spec.zone, spec.region) == (zone, region)
    assert [c[:len(asked)] for c in run.calls] == [asked]


def test_a_given_zone_asks_no_cli_and_sets_the_region():
    run = Recorded()
    spec = locate_reservation(TrainingSpec(**AWS_HELD, zone="us-west-2b"), run)
    assert (spec.zone, spec.region, run.calls) == ("us-west-2b", "us-west-2", [])


def test_without_a_signed_in_cli_the_spec_is_unchanged():
    spec = TrainingSpec(**GCP_HELD)
    assert locate_reservation(spec, _absent) == spec


def test_a_region_other_than_the_reservations_is_refused():
    with pytest.raises(GpuprovError, match="cr-0123456789abcdef0 is in zone us-east-1d.*not in region us-west-2"):
        locate_reservation(TrainingSpec(**AWS_HELD, region="us-west-2"), Recorded())


@pytest.mark.parametrize("given, problem", [
    (dict(cloud="gcp", zone="us-east-1d"), "not a gcp zone name"),
    (dict(cloud="aws", zone="us-central1-a"), "not an aws zone name"),
    (dict(cloud="azure", zone="eastus-1"), "azure takes no zone"),
    (dict(cloud="aws", zone="us-east-1d", region="us-west-2"), "is in us-east-1, not in region us-west-2"),
])
def test_a_zone_is_checked_when_the_spec_is_parsed(given, problem):
    with pytest.raises(ValueError, match=problem):
        TrainingSpec(model="llama-3.1-8b", **given)


def _gpuprov(*args: str) -> subprocess.CompletedProcess:
    # PATH without the cloud CLIs: the user who is not signed in
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    env.pop("AWS_PROFILE", None)
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def _default(text: str, variable: str) -> str | None:
    found = re.search(r'variable "' + variable + r'" \{[^}]*?default\s*=\s*("[^"]*"|null)', text, re.S)
    return json.loads(found.group(1)) if found else None


@pytest.mark.slow
def test_stated_zone_reaches_terraform_and_validate_calls_it_unchecked(tmp_path):
    root = tmp_path / "infra"
    args = ["generate", "--model", "llama-3.1-8b", "--task", "lora", "--cloud", "aws", "--gpu", "h100-80gb",
            "--gpus", "8", "--purchase", "capacity-block", "--objective", "time",
            "--capacity-reservation-id", "cr-0123456789abcdef0", "-o", str(root)]
    result = _gpuprov(*args, "--zone", "us-west-2b")
    assert result.returncode == 0, result.stderr
    plan = json.loads((root / "plan.json").read_text())
    assert (plan["spec"]["zone"], plan["cluster"]["region"]) == ("us-west-2b", "us-west-2")
    assert _default((root / "terraform" / "variables.tf").read_text(), "availability_zone") == "us-west-2b"
    validate = _gpuprov("validate", str(root), "--offline")
    assert validate.returncode == 0, validate.stdout + validate.stderr
    zone_line = next(ln for ln in validate.stdout.splitlines() if "reservation zone" in ln)
    assert zone_line.startswith("skip") and "us-west-2b" in zone_line and "unchecked" in zone_line
    # no zone stated and no CLI to ask: validate fails and says how to find the zone
    other = tmp_path / "other"
    assert _gpuprov(*args[:-1], str(other)).returncode == 0
    assert _default((other / "terraform" / "variables.tf").read_text(), "availability_zone") is None
    validate = _gpuprov("validate", str(other), "--offline")
    assert validate.returncode != 0
    assert any(ln.startswith("fail") and "availability_zone is not set" in ln for ln in validate.stdout.splitlines())


def _gcp_plan(zone: str | None):
    from plan_fixtures import sample_plan, with_bringup

    plan = sample_plan("gcp", nodes=2)
    spec = plan.spec.model_copy(update={"reservation": "a3-pool", "zone": zone})
    purchase = plan.purchase.model_copy(update={"option": "reservation", "held": "a3-pool"})
    return with_bringup(plan.model_copy(update={"spec": spec, "purchase": purchase}))


def test_live_check_compares_the_zone_with_the_reservations(tmp_path):
    (tmp_path / "terraform").mkdir()
    (tmp_path / "terraform" / "terraform.tfvars").write_text('zone = "us-central1-b"\nproject_id = "my-project"\n')
    checks = {c.name: c for c in live_checks(_gcp_plan(None), tmp_path, Recorded())}
    assert checks["reservation (live)"].status == "fail"
    assert "a3-pool is in us-central1-a, zone is us-central1-b" in checks["reservation (live)"].detail
    assert 'zone = "us-central1-a"' in checks["reservation (live)"].fix
    (tmp_path / "terraform" / "terraform.tfvars").write_text('project_id = "my-project"\n')
    checks = {c.name: c for c in live_checks(_gcp_plan("us-central1-a"), tmp_path, Recorded())}
    assert checks["reservation (live)"].status == "ok", checks["reservation (live)"]
    offline = {c.name: c for c in offline_checks(_gcp_plan("us-central1-a"), tmp_path)}
    assert offline["reservation zone"].status == "skip" and "us-central1-a" in offline["reservation zone"].detail
