"""Pre-flight checks of `gpuprov validate`: the offline rules against the catalog and the bundle's
terraform.tfvars, and the live checks against CLI answers in the tools' own JSON shape
(tests/data/cli/), through an injected runner that records every command asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuprov.preflight import live_checks, offline_checks, preflight
from plan_fixtures import sample_plan, with_bringup

CLI = Path(__file__).resolve().parent / "data" / "cli"


class Recorded:
    """Answers a CLI call with tests/data/cli/<tool>-<words>.json; overrides patch the JSON."""

    def __init__(self, **patch):
        self.calls: list[list[str]] = []
        self.patch = patch

    def __call__(self, argv: list[str]) -> tuple[int, str]:
        self.calls.append(argv)
        words = [a for a in argv if not a.startswith("-")][:4]
        for n in (4, 3, 2):
            path = CLI / ("-".join(words[:n]) + ".json")
            if path.is_file():
                data = json.loads(path.read_text())
                for key, fn in self.patch.items():
                    if key in path.name:
                        data = fn(data)
                return 0, json.dumps(data)
        return 1, ""


def _bundle(tmp_path: Path, plan, tfvars: str = "") -> Path:
    (tmp_path / "terraform").mkdir(parents=True, exist_ok=True)
    if tfvars:
        (tmp_path / "terraform" / "terraform.tfvars").write_text(tfvars)
    return tmp_path


def _aws(nodes=2, **spec):
    plan = sample_plan("aws", nodes=nodes)
    plan = plan.model_copy(update={"spec": plan.spec.model_copy(update=spec),
                                   "instance": plan.instance.model_copy(update={"name": "p5en.48xlarge"}),
                                   "cluster": plan.cluster.model_copy(update={"instance_type": "p5en.48xlarge"})})
    return with_bringup(plan, "p5en.48xlarge")


def _by_name(checks):
    return {c.name: c for c in checks}


def test_offline_rules_pass_for_a_plan_as_generated(tmp_path):
    checks = _by_name(offline_checks(_aws(), _bundle(tmp_path, None)))
    assert checks["purchase option"].status == "ok"
    assert checks["region"].status == "ok"
    quota = checks["quota"]
    assert "384 vCPUs of L-417A185B" in quota.detail  # 2 x p5en (192 vCPUs)
    assert "request-service-quota-increase" in quota.fix and "--desired-value 384" in quota.fix


def test_a_purchase_option_the_type_is_not_sold_with_fails(tmp_path):
    root = _bundle(tmp_path, None, 'instance_type = "p5e.48xlarge"\npurchase_option = "on-demand"\n')
    check = _by_name(offline_checks(_aws(), root))["purchase option"]
    assert check.status == "fail" and "capacity-block" in check.detail and "--purchase capacity-block" in check.fix


def test_a_reservation_without_its_zone_fails_offline(tmp_path):
    plan = _aws(capacity_reservation_id="cr-0123456789abcdef0")
    assert plan.purchase.option == "reservation"
    check = _by_name(offline_checks(plan, _bundle(tmp_path, None)))["reservation zone"]
    assert check.status == "fail" and "availability_zone" in check.detail
    ok = _by_name(offline_checks(plan, _bundle(tmp_path / "z", None, 'availability_zone = "us-east-1d"\n')))
    # the zone as the user states it: unchecked offline (finding 5), compared with the reservation live
    assert ok["reservation zone"].status == "skip" and "unchecked" in ok["reservation zone"].detail
    assert "reservation's capacity counts" in ok["quota"].detail


def test_unknown_region_in_tfvars_fails_and_another_known_one_is_left_to_the_live_check(tmp_path):
    bad = _by_name(offline_checks(_aws(), _bundle(tmp_path / "a", None, 'region = "us-est-1"\n')))["region"]
    assert bad.status == "fail"
    other = _by_name(offline_checks(_aws(), _bundle(tmp_path / "b", None, 'region = "eu-west-1"\n')))["region"]
    assert other.status == "skip" and "describe-instance-type-offerings" in other.fix


def test_gcp_spot_quota_is_the_preemptible_metric(tmp_path):
    plan = sample_plan("gcp", nodes=2)
    spot = with_bringup(plan.model_copy(update={"spec": plan.spec.model_copy(update={"purchase": ["spot"]})}))
    assert spot.purchase.option == "spot"
    assert "PREEMPTIBLE_NVIDIA_H100_MEGA_GPUS" in _by_name(offline_checks(spot, _bundle(tmp_path, None)))["quota"].detail


# ---- live, against recorded CLI answers ----------------------------------------------------------

def test_live_aws_checks_pass_and_ask_exactly_these_commands(tmp_path):
    runner = Recorded()
    plan = _aws(nodes=2, capacity_reservation_id="cr-0123456789abcdef0")
    checks = _by_name(live_checks(plan, _bundle(tmp_path, None, 'availability_zone = "us-east-1d"\n'), runner))
    assert [c.status for c in checks.values()] == ["ok", "ok", "skip"], checks  # reservation: no vCPU quota
    assert "us-east-1a, us-east-1d" in checks["offered (live)"].detail
    assert "2 x p5en.48xlarge free in us-east-1d" in checks["reservation (live)"].detail
    assert [c[:3] for c in runner.calls] == [["aws", "sts", "get-caller-identity"],
                                             ["aws", "ec2", "describe-instance-type-offerings"],
                                             ["aws", "ec2", "describe-capacity-reservations"]]


def test_live_aws_finds_a_small_reservation_a_wrong_zone_and_a_low_quota(tmp_path):
    root = _bundle(tmp_path, None, 'availability_zone = "us-east-1b"\nnode_count = 3\n')
    plan = _aws(capacity_reservation_id="cr-0123456789abcdef0")
    checks = _by_name(live_checks(plan, root, Recorded()))
    assert checks["offered (live)"].status == "fail" and "not us-east-1b" in checks["offered (live)"].detail
    reservation = checks["reservation (live)"]
    assert reservation.status == "fail"
    assert "2 instances free, the plan needs 3" in reservation.detail and "us-east-1d" in reservation.detail
    quota = _by_name(live_checks(_aws(nodes=3), _bundle(tmp_path / "q", None), Recorded()))["quota (live)"]
    assert quota.status == "fail" and "384 vCPUs allowed, the plan needs 576" in quota.detail
    assert "--desired-value 576" in quota.fix


def test_live_gcp_checks(tmp_path):
    plan = sample_plan("gcp", nodes=2)
    plan = with_bringup(plan.model_copy(update={"spec": plan.spec.model_copy(update={"reservation": "a3-pool"})}))
    root = _bundle(tmp_path, None, 'zone = "us-central1-a"\nproject_id = "my-project"\n')
    checks = _by_name(live_checks(plan, root, Recorded()))
    assert checks["offered (live)"].detail == "a3-megagpu-8g in us-central1-a, us-central1-c"
    assert checks["reservation (live)"].status == "ok" and "3 x a3-megagpu-8g free" in checks["reservation (live)"].detail
    assert checks["quota (live)"].status == "ok"
    short = Recorded(regions=lambda d: {**d, "quotas": [{"metric": "NVIDIA_H100_MEGA_GPUS", "limit": 8.0, "usage": 0}]})
    quota = _by_name(live_checks(plan, root, short))["quota (live)"]
    assert quota.status == "fail" and "8 GPUs free in us-central1, the plan needs 16" in quota.detail


def test_live_checks_skip_without_cli_or_login(tmp_path):
    root = _bundle(tmp_path, None)
    missing = live_checks(_aws(), root, lambda argv: (127, ""))
    assert [c.status for c in missing] == ["skip"] and "aws is not on PATH" in missing[0].detail
    assert "getting-started-install" in missing[0].fix  # each skip says how to install what is missing
    logged_out = live_checks(_aws(), root, lambda argv: (255, ""))
    assert logged_out[0].status == "skip" and logged_out[0].fix.startswith("aws sso login")
    # on-prem: no cloud rules, only the shared filesystem of a multi-node plan
    assert [c.name for c in preflight(sample_plan("onprem"), root)] == ["shared storage"]


@pytest.mark.slow
def test_validate_prints_the_preflight_with_fixes(tmp_path):
    import subprocess
    import sys

    from bundle_fixtures import standin_renderers
    from gpuprov import bundle

    root = tmp_path / "infra"
    bundle.write_bundle(root, bundle.build_bundle(_aws(), standin_renderers()), force=True)
    (root / "terraform").mkdir(exist_ok=True)
    (root / "terraform" / "terraform.tfvars").write_text('purchase_option = "capacity-block"\ninstance_type = "g5.xlarge"\n')
    proc = subprocess.run([sys.executable, "-m", "gpuprov", "validate", str(root), "--offline"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "fail  purchase option   g5.xlarge cannot be bought capacity-block" in proc.stdout
    assert "fix: gpuprov generate --purchase on-demand" in proc.stdout


# ---- a subnet the user names: its routes (issue 27 finding 2) ------------------------------------

SUBNET = 'subnet_id = "subnet-0123456789abcdef0"\navailability_zone = "us-east-1d"\n'


def _routes(**default_route):
    """describe-route-tables with the 0.0.0.0/0 route replaced (None: removed)."""
    def patch(data):
        table = data["RouteTables"][0]
        routes = [r for r in table["Routes"] if r.get("DestinationCidrBlock") != "0.0.0.0/0"]
        if default_route:
            routes.append({"DestinationCidrBlock": "0.0.0.0/0", "Origin": "CreateRoute", "State": "active",
                           **default_route})
        return {"RouteTables": [{**table, "Routes": routes}]}
    return patch


def _subnet_check(tmp_path, runner, tfvars=SUBNET):
    return _by_name(live_checks(_aws(), _bundle(tmp_path, None, tfvars), runner)).get("subnet (live)")


def test_a_private_subnet_with_a_nat_route_passes(tmp_path):
    runner = Recorded()
    check = _subnet_check(tmp_path, runner)
    assert check.status == "ok" and "nat-06c018cbd8EXAMPLE" in check.detail
    asked = [a for a in runner.calls if "describe-route-tables" in a]
    assert asked and "Name=association.subnet-id,Values=subnet-0123456789abcdef0" in asked[0]


def test_without_a_subnet_the_bundle_brings_its_network_and_no_route_check_runs(tmp_path):
    runner = Recorded()
    assert _subnet_check(tmp_path, runner, "") is None
    assert not any("describe-route-tables" in a for a in runner.calls)


@pytest.mark.parametrize("route, words", [
    ({"GatewayId": "igw-0e5f4c3b2aEXAMPLE"}, "is public"),
    ({"NatGatewayId": "nat-06c018cbd8EXAMPLE", "State": "blackhole"}, "blackhole"),
    ({}, "ssm, ssmmessages, ec2messages"),  # no route out, only the S3 gateway endpoint
])
def test_a_subnet_the_nodes_cannot_work_from_fails(route, words, tmp_path):
    check = _subnet_check(tmp_path, Recorded(**{"route-tables": _routes(**route)}))
    assert check.status == "fail" and words in check.detail, check
    assert "leave subnet_id unset" in check.fix


def test_ssm_endpoints_without_a_route_out_still_fail_for_packages(tmp_path):
    endpoints = {"VpcEndpoints": [{"ServiceName": f"com.amazonaws.us-east-1.{n}", "State": "available",
                                   "VpcEndpointType": "Interface", "VpcId": "vpc-0a1b2c3d4e5f67890"}
                                  for n in ("ssm", "ssmmessages", "ec2messages")]}
    runner = Recorded(**{"route-tables": _routes(), "vpc-endpoints": lambda d: endpoints})
    check = _subnet_check(tmp_path, runner)
    assert check.status == "fail" and "apt, pip" in check.detail


def test_a_subnet_without_its_own_route_table_is_judged_by_the_main_one(tmp_path):
    main = json.loads((CLI / "aws-ec2-describe-route-tables.json").read_text())
    main["RouteTables"][0]["Associations"] = [{"Main": True, "RouteTableId": "rtb-main", "AssociationState":
                                               {"State": "associated"}}]
    main["RouteTables"][0]["Routes"][1] = {"DestinationCidrBlock": "0.0.0.0/0", "GatewayId": "igw-0e5f4c3b2aEXAMPLE",
                                           "Origin": "CreateRoute", "State": "active"}
    recorded = Recorded()

    def runner(argv):
        if "describe-route-tables" in argv:
            recorded.calls.append(argv)
            main_asked = "Name=association.main,Values=true" in argv
            return 0, json.dumps(main if main_asked else {"RouteTables": []})
        return recorded(argv)

    check = _subnet_check(tmp_path, runner)
    assert check.status == "fail" and "is public" in check.detail
    assert any("Name=vpc-id,Values=vpc-0a1b2c3d4e5f67890" in a for a in recorded.calls)


def test_a_subnet_in_another_zone_than_stated_fails(tmp_path):
    check = _subnet_check(tmp_path, Recorded(), SUBNET.replace("us-east-1d", "us-east-1a"))
    assert check.status == "fail" and "us-east-1d" in check.detail
