"""AWS's live checks for `gpuprov validate` (the AWS CLI, answers parsed as the CLI prints them):
the instance type's offerings per zone, the capacity reservation, the user's subnet routes, the vCPU quota.
gpuprov/targets/aws.py names them; imported when validate runs them (they read the catalog, which reads
the target registry)."""

from __future__ import annotations

import shlex
from typing import Any

from gpuprov.catalog import bringup as cat
from gpuprov.catalog.instances import get_instance
from gpuprov.targets.aws import TARGET
from gpuprov.targets.live import Check, LiveCheck, Runner, cli_json, offered_in, q


def checks(s: dict) -> list[LiveCheck]:
    """The checks that apply to these settings (terraform.tfvars over the plan's defaults)."""
    found: list[LiveCheck] = [offerings]
    if s["purchase"] in ("reservation", "capacity-block") and s["held"]:
        found.append(reservation)
    if s["subnet"]:
        found.append(subnet_routes)
    return [*found, quota]


def held_zone(held: str, region: str | None, run: Runner) -> str | None:
    """The availability zone of ODCR / Capacity Block `held` (None: the CLI does not know it)."""
    argv = ["aws", "ec2", "describe-capacity-reservations", "--capacity-reservation-ids", held, "--output", "json"]
    found = (cli_json(run, argv + (["--region", region] if region else [])) or {}).get("CapacityReservations") or []
    zone = found[0].get("AvailabilityZone") if found and isinstance(found[0], dict) else None
    return zone if isinstance(zone, str) else None


def offerings(plan: Any, s: dict, run: Runner) -> Check:
    argv = ["aws", "ec2", "describe-instance-type-offerings", "--location-type", "availability-zone",
            "--filters", f"Name=instance-type,Values={s['instance']}", "--region", s["region"], "--output", "json"]
    data = cli_json(run, argv)
    if data is None:
        return Check("fail", "offered (live)", "describe-instance-type-offerings failed", shlex.join(argv))
    zones = sorted(o["Location"] for o in data.get("InstanceTypeOfferings", []))
    return offered_in(s, zones, "instance type", "set availability_zone and a subnet_id in one of those zones")


def reservation(plan: Any, s: dict, run: Runner) -> Check:
    argv = ["aws", "ec2", "describe-capacity-reservations", "--capacity-reservation-ids", s["held"],
            "--region", s["region"], "--output", "json"]
    data = cli_json(run, argv)
    found = (data or {}).get("CapacityReservations") or []
    if not found:
        return Check("fail", "reservation (live)", f"{s['held']} not found in {s['region']}", shlex.join(argv))
    r = found[0]
    problems = []
    if r.get("State") not in ("active", "scheduled"):
        problems.append(f"state {r.get('State')}")
    if r.get("InstanceType") != s["instance"]:
        problems.append(f"it holds {r.get('InstanceType')}, not {s['instance']}")
    if int(r.get("AvailableInstanceCount", 0)) < s["nodes"]:
        problems.append(f"{r.get('AvailableInstanceCount', 0)} instances free, the plan needs {s['nodes']}")
    if s["zone"] and r.get("AvailabilityZone") != s["zone"]:
        problems.append(f"it is in {r.get('AvailabilityZone')}, availability_zone is {s['zone']}")
    if problems:
        return Check("fail", "reservation (live)", f"{s['held']}: " + "; ".join(problems),
                     f"set availability_zone = \"{r.get('AvailabilityZone')}\" and node_count, or another reservation")
    return Check("ok", "reservation (live)", f"{s['held']}: {r['AvailableInstanceCount']} x {s['instance']} free "
                 f"in {r['AvailabilityZone']} ({r['State']})")


SSM_ENDPOINTS = ("ssm", "ssmmessages", "ec2messages")  # what Session Manager needs without a NAT route


def subnet_routes(plan: Any, s: dict, run: Runner) -> Check:
    """A subnet the user names: the nodes (no public address) need a NAT route (or another egress)
    for SSM, apt and pip; a route to an internet gateway gives private nodes nothing."""
    aws = ["--region", s["region"], "--output", "json"]
    subnets = (cli_json(run, ["aws", "ec2", "describe-subnets", "--subnet-ids", s["subnet"], *aws]) or {}).get("Subnets")
    if not subnets:
        return Check("fail", "subnet (live)", f"{s['subnet']} not found in {s['region']}",
                     "leave subnet_id unset: the bundle creates a VPC with a private subnet and a NAT gateway")
    subnet = subnets[0]
    if s["zone"] and subnet.get("AvailabilityZone") != s["zone"]:
        return Check("fail", "subnet (live)", f"{s['subnet']} is in {subnet.get('AvailabilityZone')}, "
                     f"availability_zone is {s['zone']}", "name a subnet in that zone, or leave subnet_id unset")
    tables = (cli_json(run, ["aws", "ec2", "describe-route-tables", "--filters",
                          f"Name=association.subnet-id,Values={s['subnet']}", *aws]) or {}).get("RouteTables")
    if not tables:  # no explicit association: the VPC's main route table applies
        tables = (cli_json(run, ["aws", "ec2", "describe-route-tables", "--filters", f"Name=vpc-id,Values={subnet['VpcId']}",
                              "Name=association.main,Values=true", *aws]) or {}).get("RouteTables") or []
    routes = [r for t in tables[:1] for r in t.get("Routes", []) if r.get("DestinationCidrBlock") == "0.0.0.0/0"]
    default = routes[0] if routes else None
    fix = "leave subnet_id unset (the bundle creates a private subnet with a NAT gateway), or add a NAT route"
    if default is not None and default.get("State") == "blackhole":
        return Check("fail", "subnet (live)", f"{s['subnet']}: its default route is a blackhole", fix)
    target = default and next((default[k] for k in ("NatGatewayId", "TransitGatewayId", "NetworkInterfaceId",
                                                     "InstanceId") if default.get(k)), None)
    if target:
        return Check("ok", "subnet (live)", f"{s['subnet']} ({subnet.get('AvailabilityZone')}): egress through {target}")
    if default is not None and str(default.get("GatewayId", "")).startswith("igw-"):
        return Check("fail", "subnet (live)", f"{s['subnet']} is public (0.0.0.0/0 -> {default['GatewayId']}): nodes "
                     "without a public address get no egress there, SSM never registers, apt and pip fail", fix)
    endpoints = (cli_json(run, ["aws", "ec2", "describe-vpc-endpoints", "--filters",
                             f"Name=vpc-id,Values={subnet['VpcId']}", *aws]) or {}).get("VpcEndpoints") or []
    have = {e.get("ServiceName", "").rsplit(".", 1)[-1] for e in endpoints if e.get("State", "available") == "available"}
    missing = [name for name in SSM_ENDPOINTS if name not in have]
    if missing:
        return Check("fail", "subnet (live)", f"{s['subnet']} has no route out and its VPC lacks the "
                     f"{', '.join(missing)} endpoint(s): SSM cannot reach the nodes", fix)
    return Check("fail", "subnet (live)", f"{s['subnet']}: SSM endpoints carry the sessions, but with no route out "
                 "apt, pip and the EFA installer cannot download", fix)


def quota(plan: Any, s: dict, run: Runner) -> Check:
    inst = get_instance(s["instance"])
    quotas = cat.quota("aws") or {}
    entry = quotas.get("codes", {}).get(TARGET.quota_family(inst.name))
    if entry is None or s["purchase"] in ("reservation", "capacity-block"):
        return Check("skip", "quota (live)", "no vCPU quota applies" if entry else f"no quota code for {inst.name}")
    code = entry["spot" if s["purchase"] == "spot" else "on-demand"]
    argv = ["aws", "service-quotas", "get-service-quota", "--service-code", "ec2", "--quota-code", code,
            "--region", s["region"], "--output", "json"]
    data = cli_json(run, argv)
    if data is None:
        return Check("fail", "quota (live)", f"get-service-quota {code} failed", shlex.join(argv))
    have, need = float(data["Quota"]["Value"]), s["nodes"] * (inst.vcpus or 0)
    if have < need:
        return Check("fail", "quota (live)", f"{code}: {have:.0f} vCPUs allowed, the plan needs {need}",
                     quotas["fix"].format(code=q(code), need=need, region=q(s["region"])))
    return Check("ok", "quota (live)", f"{code}: {have:.0f} vCPUs allowed >= {need} needed")
