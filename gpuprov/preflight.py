"""Pre-flight checks for `gpuprov validate`: will the cloud let this bundle come up?

Offline rules read the plan, the catalog and the bundle's terraform.tfvars (the values `up` will
use): the purchase option can buy the instance type, the region is the one the catalog knows the
type in, a reservation names its zone, and the quota to request. Live checks run only when the
cloud's CLI is on PATH and logged in: instance-type offerings per zone, the reservation exists and
has room, the quota. Each check gives (status, name, detail, fix command); `run` is injectable so
tests answer with recorded CLI JSON.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from gpuprov.catalog import bringup as cat
from gpuprov.catalog.instances import get_instance
from gpuprov.errors import GpuprovError
from gpuprov.targets import get_target

Runner = Callable[[list[str]], tuple[int, str]]


@dataclass(frozen=True)
class Check:
    status: str  # ok | fail | skip
    name: str
    detail: str
    fix: str = ""


INSTALL_FIX = {
    "aws": "install the AWS CLI v2: https://docs.aws.amazon.com/cli/latest/userguide/getting-started-install.html",
    "gcp": "install the gcloud CLI: https://cloud.google.com/sdk/docs/install",
}
LOGIN_FIX = {"aws": "aws sso login (or aws configure)", "gcp": "gcloud auth login"}


def run_cli(argv: list[str]) -> tuple[int, str]:
    """(exit code, stdout) of a cloud CLI; 127 when it is not on PATH."""
    if shutil.which(argv[0]) is None:
        return 127, ""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 1, ""
    return proc.returncode, proc.stdout


_TFVAR = re.compile(r'^\s*([a-z_][a-z0-9_]*)\s*=\s*(?:"([^"]*)"|([0-9]+|true|false|null))\s*(?:#.*)?$', re.M)


def tfvars(root: Path) -> dict[str, Any]:
    """Scalar values set in terraform/terraform.tfvars (what `up` passes over the plan defaults)."""
    path = root / "terraform" / "terraform.tfvars"
    if not path.is_file():
        return {}
    out: dict[str, Any] = {}
    for key, text, bare in _TFVAR.findall(path.read_text(encoding="utf-8")):
        out[key] = text if not bare else {"true": True, "false": False, "null": None}.get(bare, bare)
        if bare.isdigit():
            out[key] = int(bare)
    return out


def settings(plan: Any, root: Path) -> dict[str, Any]:
    """The values the bundle will apply with: plan defaults, overridden by terraform.tfvars."""
    given = tfvars(root)
    keys = get_target(plan.cluster.cloud).tfvars
    if keys is None:
        raise GpuprovError(f"{plan.cluster.cloud} takes no Terraform variables")
    return {
        "instance": given.get(keys.instance, plan.instance.name),
        "region": given.get(keys.region, plan.instance.region),
        "nodes": int(given.get("node_count", plan.cluster.nodes)),
        "purchase": given.get("purchase_option", plan.purchase.option),
        "held": given.get(keys.held, plan.purchase.held),
        "zone": given.get(keys.zone),
        "project": given.get("project_id"),
        "subnet": given.get(keys.subnet) if keys.subnet else None,
    }


# ---------------------------------------------------------------- offline rules


def offline_checks(plan: Any, root: Path) -> list[Check]:
    s = settings(plan, root)
    try:
        inst = get_instance(s["instance"])
    except GpuprovError as exc:
        return [Check("fail", "instance type", str(exc), "gpuprov instances")]
    checks = [_purchase_rule(inst, s), _region_rule(plan, inst, s), _reservation_zone_rule(plan, s),
              _provider_support_rule(plan, s)]
    checks.append(_quota_rule(plan, inst, s))
    return [c for c in checks if c is not None]


def _purchase_rule(inst: Any, s: dict) -> Check:
    offered = cat.offered_options(inst)
    if s["purchase"] in offered:
        return Check("ok", "purchase option", f"{inst.name} is sold {s['purchase']} ({', '.join(offered)})")
    return Check("fail", "purchase option", f"{inst.name} cannot be bought {s['purchase']}: it is sold "
                 f"{', '.join(offered)} only", f"gpuprov generate --purchase {offered[0]} ...")


def _region_rule(plan: Any, inst: Any, s: dict) -> Check:
    names, source = cat.known_regions(plan.cluster.cloud)
    if names and s["region"] not in names:
        return Check("fail", "region", f"{s['region']} is not a region of {plan.cluster.cloud} ({source})",
                     "set region in terraform/terraform.tfvars")
    if s["region"] == inst.region:
        return Check("ok", "region", f"{inst.name} is offered in {s['region']} (catalog: {inst.price_source})")
    return Check("skip", "region", f"the catalog knows {inst.name} in {inst.region} only; {s['region']} "
                 "is checked live", _offerings_command(plan.cluster.cloud, inst.name, s["region"]))


def _reservation_zone_rule(plan: Any, s: dict) -> Check | None:
    if s["purchase"] not in ("reservation", "capacity-block"):
        return None
    if not s["held"]:
        return Check("fail", "reservation", f"purchase option {s['purchase']} names no reservation",
                     "set capacity_reservation_id / reservation_name in terraform/terraform.tfvars")
    if plan.cluster.cloud == "aws" and not s["zone"]:
        return Check("fail", "reservation zone", f"{s['held']} lives in one availability zone: "
                     "availability_zone is not set", "aws ec2 describe-capacity-reservations --capacity-reservation-ids "
                     f"{s['held']} --query 'CapacityReservations[0].AvailabilityZone'")
    return Check("skip", "reservation zone", f"{s['held']} in {s['zone'] or 'the VMs zone'} as terraform.tfvars "
                 "states it: unchecked offline (the live check compares it with the reservation)",
                 LOGIN_FIX.get(plan.cluster.cloud, ""))


def _provider_support_rule(plan: Any, s: dict) -> Check | None:
    """A provisioning model the pinned provider may not send as written (checked by no schema)."""
    model = {"flex-start": "FLEX_START"}.get(s["purchase"])
    if s["purchase"] == "reservation" and plan.purchase.reservation_bound:
        model = "RESERVATION_BOUND"
    fact = cat.provider_support(plan.cluster.cloud).get(model or "")
    if not fact:
        return None
    return Check("skip", "provider support", f"provisioning_model {model}: hashicorp/google added it to its instance "
                 f"resources in {fact['since']} ({fact['source']}); terraform/versions.tf pins an earlier line, "
                 "whose handling of it no schema shows: unchecked",
                 f"after `terraform plan`, check it shows provisioning_model = \"{model}\"; if it shows STANDARD, "
                 "raise the hashicorp/google pin in terraform/versions.tf to a release that carries it")


def _family(cloud: str, name: str) -> str:
    if cloud == "aws":
        return name[:1]  # EC2 quotas are per family letter: p5en -> p, g6e -> g
    return name.rsplit("-", 1)[0] if cloud == "gcp" else name


def _quota_rule(plan: Any, inst: Any, s: dict) -> Check:
    entry = cat.quota(plan.cluster.cloud)
    spot = s["purchase"] in ("spot", "flex-start")
    if entry is None:
        return Check("skip", "quota", f"no quota names for {plan.cluster.cloud} in the catalog: "
                     f"request {s['nodes'] * inst.gpus} GPUs ({s['nodes']} x {inst.name})")
    if entry["unit"] == "vcpus":
        code = entry["codes"].get(_family("aws", inst.name))
        need = s["nodes"] * (inst.vcpus or 0)
        if code is None:
            return Check("skip", "quota", f"no quota code for {inst.name}: request {need} vCPUs")
        quota_code = code["spot" if spot else "on-demand"]
        if s["purchase"] in ("reservation", "capacity-block"):
            return Check("ok", "quota", f"{s['purchase']}: the reservation's capacity counts, not {quota_code}")
        return Check("ok", "quota", f"request {need} vCPUs of {quota_code} ({code['name']}) in {s['region']}",
                     f"aws service-quotas request-service-quota-increase --service-code ec2 --quota-code "
                     f"{quota_code} --desired-value {need} --region {s['region']}")
    metric = entry["metrics"].get(_family("gcp", inst.name))
    need = s["nodes"] * inst.gpus
    if metric is None:
        return Check("skip", "quota", f"no quota metric for {inst.name}: request {need} GPUs")
    metric = (entry["preemptible_prefix"] if spot else "") + metric
    return Check("ok", "quota", f"request {need} of {metric} in {s['region']}",
                 f"gcloud compute regions describe {s['region']} --format=json  (quotas: {metric})")


def _offerings_command(cloud: str, name: str, region: str) -> str:
    if cloud == "aws":
        return (f"aws ec2 describe-instance-type-offerings --location-type availability-zone "
                f"--filters Name=instance-type,Values={name} --region {region}")
    if cloud == "gcp":
        return f"gcloud compute machine-types list --filter=name={name} --format=json"
    return ""


# ---------------------------------------------------------------- live checks


def live_checks(plan: Any, root: Path, run: Runner = run_cli) -> list[Check]:
    cloud = plan.cluster.cloud
    if not get_target(cloud).live_checks:
        return [Check("skip", "live checks", f"gpuprov has no live checks for {cloud}: offerings and quota "
                      "are unchecked until `terraform plan`", "validate --offline runs the offline rules only")]
    s = settings(plan, root)
    login = ["aws", "sts", "get-caller-identity", "--output", "json"] if cloud == "aws" else \
        ["gcloud", "auth", "list", "--filter=status:ACTIVE", "--format=json"]
    code, out = run(login)
    if code == 127:
        return [Check("skip", "live checks", f"{login[0]} is not on PATH: offerings, reservation, quota and "
                      "subnet routes are unchecked", INSTALL_FIX[cloud])]
    if code != 0 or not _logged_in(cloud, out):
        return [Check("skip", "live checks", f"{login[0]} is not logged in: offerings, reservation, quota and "
                      "subnet routes are unchecked", LOGIN_FIX[cloud])]
    checks = [_aws_offerings if cloud == "aws" else _gcp_offerings]
    if s["purchase"] in ("reservation", "capacity-block") and s["held"]:
        checks.append(_aws_reservation if cloud == "aws" else _gcp_reservation)
    if cloud == "aws" and s["subnet"]:
        checks.append(_aws_subnet_routes)
    checks.append(_aws_quota if cloud == "aws" else _gcp_quota)
    return [check(plan, s, run) for check in checks]


def _logged_in(cloud: str, out: str) -> bool:
    try:
        data = json.loads(out or "null")
    except ValueError:
        return False
    return bool(data.get("Account")) if cloud == "aws" and isinstance(data, dict) else bool(data)


def _json(run: Runner, argv: list[str]) -> Any:
    code, out = run(argv)
    if code != 0:
        return None
    try:
        return json.loads(out)
    except ValueError:
        return None


def _aws_offerings(plan: Any, s: dict, run: Runner) -> Check:
    argv = ["aws", "ec2", "describe-instance-type-offerings", "--location-type", "availability-zone",
            "--filters", f"Name=instance-type,Values={s['instance']}", "--region", s["region"], "--output", "json"]
    data = _json(run, argv)
    if data is None:
        return Check("fail", "offered (live)", "describe-instance-type-offerings failed", " ".join(argv))
    zones = sorted(o["Location"] for o in data.get("InstanceTypeOfferings", []))
    return _offered_in(s, zones, "instance type", "set availability_zone and a subnet_id in one of those zones")


def _offered_in(s: dict, zones: list[str], kind: str, zone_hint: str) -> Check:
    """The live offering check from the zones the cloud lists for the plan's machine type."""
    if not zones:
        return Check("fail", "offered (live)", f"{s['instance']} is not offered in {s['region']}",
                     f"pick another region (--region) or {kind}")
    if s["zone"] and s["zone"] not in zones:
        return Check("fail", "offered (live)", f"{s['instance']} is offered in {', '.join(zones)}, not {s['zone']}",
                     zone_hint)
    return Check("ok", "offered (live)", f"{s['instance']} in {', '.join(zones)}")


def _aws_reservation(plan: Any, s: dict, run: Runner) -> Check:
    argv = ["aws", "ec2", "describe-capacity-reservations", "--capacity-reservation-ids", s["held"],
            "--region", s["region"], "--output", "json"]
    data = _json(run, argv)
    found = (data or {}).get("CapacityReservations") or []
    if not found:
        return Check("fail", "reservation (live)", f"{s['held']} not found in {s['region']}", " ".join(argv))
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


def _aws_subnet_routes(plan: Any, s: dict, run: Runner) -> Check:
    """A subnet the user names: the nodes (no public address) need a NAT route (or another egress)
    for SSM, apt and pip; a route to an internet gateway gives private nodes nothing."""
    aws = ["--region", s["region"], "--output", "json"]
    subnets = (_json(run, ["aws", "ec2", "describe-subnets", "--subnet-ids", s["subnet"], *aws]) or {}).get("Subnets")
    if not subnets:
        return Check("fail", "subnet (live)", f"{s['subnet']} not found in {s['region']}",
                     "leave subnet_id unset: the bundle creates a VPC with a private subnet and a NAT gateway")
    subnet = subnets[0]
    if s["zone"] and subnet.get("AvailabilityZone") != s["zone"]:
        return Check("fail", "subnet (live)", f"{s['subnet']} is in {subnet.get('AvailabilityZone')}, "
                     f"availability_zone is {s['zone']}", "name a subnet in that zone, or leave subnet_id unset")
    tables = (_json(run, ["aws", "ec2", "describe-route-tables", "--filters",
                          f"Name=association.subnet-id,Values={s['subnet']}", *aws]) or {}).get("RouteTables")
    if not tables:  # no explicit association: the VPC's main route table applies
        tables = (_json(run, ["aws", "ec2", "describe-route-tables", "--filters", f"Name=vpc-id,Values={subnet['VpcId']}",
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
    endpoints = (_json(run, ["aws", "ec2", "describe-vpc-endpoints", "--filters",
                             f"Name=vpc-id,Values={subnet['VpcId']}", *aws]) or {}).get("VpcEndpoints") or []
    have = {e.get("ServiceName", "").rsplit(".", 1)[-1] for e in endpoints if e.get("State", "available") == "available"}
    missing = [name for name in SSM_ENDPOINTS if name not in have]
    if missing:
        return Check("fail", "subnet (live)", f"{s['subnet']} has no route out and its VPC lacks the "
                     f"{', '.join(missing)} endpoint(s): SSM cannot reach the nodes", fix)
    return Check("fail", "subnet (live)", f"{s['subnet']}: SSM endpoints carry the sessions, but with no route out "
                 "apt, pip and the EFA installer cannot download", fix)


def _aws_quota(plan: Any, s: dict, run: Runner) -> Check:
    inst = get_instance(s["instance"])
    entry = (cat.quota("aws") or {}).get("codes", {}).get(_family("aws", inst.name))
    if entry is None or s["purchase"] in ("reservation", "capacity-block"):
        return Check("skip", "quota (live)", "no vCPU quota applies" if entry else f"no quota code for {inst.name}")
    code = entry["spot" if s["purchase"] == "spot" else "on-demand"]
    argv = ["aws", "service-quotas", "get-service-quota", "--service-code", "ec2", "--quota-code", code,
            "--region", s["region"], "--output", "json"]
    data = _json(run, argv)
    if data is None:
        return Check("fail", "quota (live)", f"get-service-quota {code} failed", " ".join(argv))
    have, need = float(data["Quota"]["Value"]), s["nodes"] * (inst.vcpus or 0)
    if have < need:
        return Check("fail", "quota (live)", f"{code}: {have:.0f} vCPUs allowed, the plan needs {need}",
                     f"aws service-quotas request-service-quota-increase --service-code ec2 --quota-code {code} "
                     f"--desired-value {need} --region {s['region']}")
    return Check("ok", "quota (live)", f"{code}: {have:.0f} vCPUs allowed >= {need} needed")


def _gcp_offerings(plan: Any, s: dict, run: Runner) -> Check:
    argv = ["gcloud", "compute", "machine-types", "list", f"--filter=name={s['instance']}", "--format=json"]
    if s["project"]:
        argv.append(f"--project={s['project']}")
    data = _json(run, argv)
    if data is None:
        return Check("fail", "offered (live)", "machine-types list failed", " ".join(argv))
    zones = sorted(m["zone"].rsplit("/", 1)[-1] for m in data if m["zone"].rsplit("/", 1)[-1].startswith(s["region"] + "-"))
    return _offered_in(s, zones, "machine type", "set zone in terraform/terraform.tfvars to one of them")


def _gcp_reservation(plan: Any, s: dict, run: Runner) -> Check:
    name = s["held"].rsplit("/", 1)[-1]
    argv = ["gcloud", "compute", "reservations", "describe", name, f"--zone={s['zone']}", "--format=json"]
    data = _json(run, argv)
    if not data:
        return Check("fail", "reservation (live)", f"reservation {name} not found in {s['zone']}", " ".join(argv))
    spec = data.get("specificReservation", {})
    free = int(spec.get("count", 0)) - int(spec.get("inUseCount", 0))
    machine = spec.get("instanceProperties", {}).get("machineType")
    problems = []
    if data.get("status") != "READY":
        problems.append(f"status {data.get('status')}")
    if machine and machine != s["instance"]:
        problems.append(f"it holds {machine}, not {s['instance']}")
    if free < s["nodes"]:
        problems.append(f"{free} VMs free, the plan needs {s['nodes']}")
    if problems:
        return Check("fail", "reservation (live)", f"{name}: " + "; ".join(problems), " ".join(argv))
    return Check("ok", "reservation (live)", f"{name}: {free} x {s['instance']} free in {s['zone']}")


def _gcp_quota(plan: Any, s: dict, run: Runner) -> Check:
    inst = get_instance(s["instance"])
    entry = cat.quota("gcp") or {"metrics": {}}
    metric = entry["metrics"].get(_family("gcp", inst.name))
    if metric is None:
        return Check("skip", "quota (live)", f"no quota metric for {inst.name}")
    if s["purchase"] in ("spot", "flex-start"):
        metric = entry["preemptible_prefix"] + metric
    argv = ["gcloud", "compute", "regions", "describe", s["region"], "--format=json"]
    data = _json(run, argv)
    if data is None:
        return Check("fail", "quota (live)", "regions describe failed", " ".join(argv))
    row = next((q for q in data.get("quotas", []) if q.get("metric") == metric), None)
    need = s["nodes"] * inst.gpus
    if row is None or float(row["limit"]) - float(row.get("usage", 0)) < need:
        have = 0 if row is None else float(row["limit"]) - float(row.get("usage", 0))
        return Check("fail", "quota (live)", f"{metric}: {have:.0f} GPUs free in {s['region']}, the plan needs {need}",
                     "request more at https://console.cloud.google.com/iam-admin/quotas "
                     f"(metric {metric}, region {s['region']})")
    return Check("ok", "quota (live)", f"{metric}: {float(row['limit']) - float(row.get('usage', 0)):.0f} free >= {need}")


NFS_EXAMPLE = '{fstype: nfs, source: "nfs-server:/export/gpu", mount_point: "/shared", options: "rw,hard,noatime"}'


def shared_storage_rule(plan: Any, root: Path) -> Check:
    """Multi-node runs checkpoint to a shared filesystem: the trainer refuses to start without one."""
    nodes = plan.cluster.nodes
    if nodes < 2:
        return Check("ok", "shared storage", "one node: checkpoints stay on its own disk")
    cloud = plan.cluster.cloud
    if get_target(cloud).provisioner == "inventory":  # the user's hosts: the inventory names the mount
        mount = _inventory_vars(root).get("shared_storage_mount")
        if not mount:
            return Check("fail", "shared storage", f"{nodes} nodes and no shared filesystem: shared_storage_mount "
                         "is null in ansible/inventory.yml, so the trainer refuses to start (checkpoints of every "
                         "rank must land in one place)", f"set all.vars.shared_storage_mount in ansible/inventory.yml "
                         f"to your NFS export: {NFS_EXAMPLE}")
        return Check("ok", "shared storage", f"{mount.get('fstype', '?')} {mount.get('source', '?')} at "
                     f"{mount.get('mount_point', '?')}" if isinstance(mount, dict) else str(mount))
    keys = get_target(cloud).tfvars
    name = keys.shared if keys else ""
    value = tfvars(root).get(name, True) if name else True
    if value in (0, False):
        return Check("fail", "shared storage", f"{nodes} nodes and {name} = {str(value).lower()} in terraform.tfvars: "
                     "no shared filesystem for the checkpoints", f"remove {name} from terraform/terraform.tfvars")
    kind = plan.shared_storage.kind if plan.shared_storage else "none"
    return Check("ok" if plan.shared_storage else "fail", "shared storage", f"{kind} for {nodes} nodes' checkpoints")


def _inventory_vars(root: Path) -> dict:
    from gpuprov.specfile import read_text

    try:
        import yaml

        data = yaml.safe_load(read_text(root / "ansible" / "inventory.yml"))
    except (GpuprovError, ValueError, yaml.YAMLError):
        return {}
    found = data.get("all", {}).get("vars") if isinstance(data, dict) and isinstance(data.get("all"), dict) else None
    return found if isinstance(found, dict) else {}


def preflight(plan: Any, root: Path, *, live: bool = True, run: Runner = run_cli) -> list[Check]:
    if plan.cluster.cloud == "onprem":
        return [shared_storage_rule(plan, root)]
    return (offline_checks(plan, root) + [shared_storage_rule(plan, root)]
            + (live_checks(plan, root, run) if live else []))
