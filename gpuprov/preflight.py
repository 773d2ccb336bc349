"""Pre-flight checks for `gpuprov validate`: will the cloud let this bundle come up?

Offline rules read the plan, the catalog and the bundle's terraform.tfvars (the values `up` will
use): the purchase option can buy the instance type, the region is the one the catalog knows the
type in, a reservation names its zone, and the quota to request. Live checks run only when the
cloud's CLI is on PATH and logged in: instance-type offerings per zone, the reservation exists and
has room, the quota. Each check gives (status, name, detail, fix command); `run` is injectable so
tests answer with recorded CLI JSON.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gpuprov.catalog import bringup as cat
from gpuprov.catalog.instances import get_instance
from gpuprov.errors import GpuprovError
from gpuprov.targets import get_target
from gpuprov.targets.live import Check, Runner, q

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
    from gpuprov.safefile import read_text

    path = root / "terraform" / "terraform.tfvars"
    if not os.path.lexists(path):
        return {}
    out: dict[str, Any] = {}
    for key, text, bare in _TFVAR.findall(read_text(path, what="variables file")):
        out[key] = text if not bare else {"true": True, "false": False, "null": None}.get(bare, bare)
        if bare.isdigit():
            out[key] = int(bare)
    return out


def _node_count(value: Any) -> int:
    """terraform.tfvars node_count as a whole number within MAX_NODES, or one GpuprovError line."""
    from gpuprov.validators import MAX_NODES

    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_NODES:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise GpuprovError(f"terraform/terraform.tfvars: node_count = {shown} is not a whole number "
                           f"from 1 to {MAX_NODES:,}")
    return value


def settings(plan: Any, root: Path) -> dict[str, Any]:
    """The values the bundle will apply with: plan defaults, overridden by terraform.tfvars."""
    given = tfvars(root)
    keys = get_target(plan.cluster.cloud).tfvars
    if keys is None:
        raise GpuprovError(f"{plan.cluster.cloud} takes no Terraform variables")
    return {
        "instance": given.get(keys.instance, plan.instance.name),
        "region": given.get(keys.region, plan.instance.region),
        "nodes": _node_count(given.get("node_count", plan.cluster.nodes)),
        "purchase": given.get("purchase_option", plan.purchase.option),
        "held": given.get(keys.held, plan.purchase.held),
        "zone": given.get(keys.zone, plan.spec.zone),
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
                 "is checked live", get_target(plan.cluster.cloud).offerings_command(inst.name, s["region"]))


def _reservation_zone_rule(plan: Any, s: dict) -> Check | None:
    if s["purchase"] not in ("reservation", "capacity-block"):
        return None
    if not s["held"]:
        return Check("fail", "reservation", f"purchase option {s['purchase']} names no reservation",
                     "set capacity_reservation_id / reservation_name in terraform/terraform.tfvars")
    target = get_target(plan.cluster.cloud)
    zone_fix = target.reservation_zone_fix(s["held"])
    if zone_fix and not s["zone"]:
        return Check("fail", "reservation zone", f"{s['held']} lives in one zone: "
                     f"{target.tfvars.zone if target.tfvars else 'zone'} is not set", zone_fix)
    return Check("skip", "reservation zone", f"{s['held']} in {s['zone'] or 'the VMs zone'} as the bundle "
                 "states it (plan or terraform.tfvars): unchecked offline (the live check compares it with the "
                 "reservation)",
                 target.live.login_fix if target.live else "")


def _provider_support_rule(plan: Any, s: dict) -> Check | None:
    """A provisioning model the provider sends as written only from some release on: the bundle's
    versions.tf must pin that line (the target decides the pin; no mined schema covers it)."""
    model = {"flex-start": "FLEX_START"}.get(s["purchase"])
    if s["purchase"] == "reservation" and plan.purchase.reservation_bound:
        model = "RESERVATION_BOUND"
    fact = cat.provider_support(plan.cluster.cloud).get(model or "")
    if not fact:
        return None
    pinned = (plan.infra.inputs if plan.infra else {}).get("google_provider_version")
    if fact.get("pin") and pinned == fact["pin"]:
        return Check("ok", "provider support", f"provisioning_model {model}: terraform/versions.tf pins hashicorp/google "
                     f"{pinned}, the line that sends it ({fact['source']})")
    return Check("fail", "provider support", f"provisioning_model {model}: hashicorp/google sends it only from "
                 f"{fact['since']}; this bundle pins {pinned or 'an earlier line'}",
                 "generate the bundle again with this gpuprov (it pins the provider line the model needs)")


def _quota_rule(plan: Any, inst: Any, s: dict) -> Check:
    entry = cat.quota(plan.cluster.cloud)
    spot = s["purchase"] in ("spot", "flex-start")
    if entry is None:
        return Check("skip", "quota", f"no quota names for {plan.cluster.cloud} in the catalog: "
                     f"request {s['nodes'] * inst.gpus} GPUs ({s['nodes']} x {inst.name})")
    if entry["unit"] == "vcpus":
        code = entry["codes"].get(get_target(plan.cluster.cloud).quota_family(inst.name))
        need = s["nodes"] * (inst.vcpus or 0)
        if code is None:
            return Check("skip", "quota", f"no quota code for {inst.name}: request {need} vCPUs")
        quota_code = code["spot" if spot else "on-demand"]
        if s["purchase"] in ("reservation", "capacity-block"):
            return Check("ok", "quota", f"{s['purchase']}: the reservation's capacity counts, not {quota_code}")
        return Check("ok", "quota", f"request {need} vCPUs of {quota_code} ({code['name']}) in {s['region']}",
                     entry["fix"].format(code=q(quota_code), need=need, region=q(s["region"])))
    if entry["unit"] in ("family-vcpus", "shape-gpus"):
        return _family_quota_rule(entry, inst, s)
    metric = entry["metrics"].get(get_target(plan.cluster.cloud).quota_family(inst.name))
    need = s["nodes"] * inst.gpus
    if metric is None:
        return Check("skip", "quota", f"no quota metric for {inst.name}: request {need} GPUs")
    metric = (entry["preemptible_prefix"] if spot else "") + metric
    return Check("ok", "quota", f"request {need} of {metric} in {s['region']}",
                 entry["fix"].format(code=metric, need=need, region=q(s["region"])))


def _family_quota_rule(entry: dict, inst: Any, s: dict) -> Check:
    """Azure (vCPUs per VM family and region; Spot: one regional quota) and OCI (GPUs per shape
    family and availability domain): which quota to request, and how many."""
    vcpus = entry["unit"] == "family-vcpus"
    need = s["nodes"] * ((inst.vcpus or 0) if vcpus else inst.gpus)
    unit = "vCPUs" if vcpus else "GPUs"
    family = entry["families"].get(inst.name)
    if family is None:
        return Check("skip", "quota", f"no quota name for {inst.name} in the catalog: request {need} {unit}")
    if s["purchase"] == "spot" and entry.get("spot"):
        family = entry["spot"]
    where = s["region"] if vcpus else f"the nodes' availability domain in {s['region']}"
    fix = entry["fix"].format(code=family["code"], region=q(s["region"]), need=need,
                              kind="lowPriority" if family is entry.get("spot") else "dedicated")
    return Check("ok", "quota", f"request {need} {unit} of {family['code']} ({family['name']}) in {where}", fix)


# ---------------------------------------------------------------- live checks


def live_checks(plan: Any, root: Path, run: Runner = run_cli) -> list[Check]:
    cloud = plan.cluster.cloud
    target = get_target(cloud)
    cli = target.live
    if cli is None:
        return [Check("skip", "live checks", f"gpuprov has no live checks for {cloud}: offerings and quota "
                      "are unchecked until `terraform plan`", "validate --offline runs the offline rules only")]
    s = settings(plan, root)
    code, out = run(list(cli.login))
    if code == 127:
        return [Check("skip", "live checks", f"{cli.login[0]} is not on PATH: offerings, reservation, quota and "
                      "subnet routes are unchecked", cli.install_fix)]
    if code != 0 or not cli.logged_in(out):
        return [Check("skip", "live checks", f"{cli.login[0]} is not logged in: offerings, reservation, quota and "
                      "subnet routes are unchecked", cli.login_fix)]
    return [check(plan, s, run) for check in target.live_checks(s)]


def locate_reservation(spec: Any, run: Runner = run_cli) -> Any:
    """The spec with the zone (and so the region) of the reservation it names, asked of the cloud's
    CLI when it is signed in; unchanged when the user gave the zone (--zone: no CLI call), or the
    CLI cannot say (then the user states the zone, and validate reports it unchecked)."""
    from gpuprov.targets import CHOICES

    if spec.zone is not None or spec.cloud not in CHOICES or spec.cloud == "any":
        return spec
    target = get_target(spec.cloud)
    held = target.held_id(spec, "reservation") if target.tfvars and target.tfvars.held else None
    if not held or target.live is None:
        return spec
    zone = target.held_zone(held, spec.region, run)  # one CLI call: fails fast when not signed in
    if zone is None:
        return spec
    data = spec.model_dump(exclude_none=True) | {"zone": zone}
    try:
        return type(spec).model_validate(data)
    except ValidationError as exc:  # e.g. --region names another region than the reservation's
        why = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise GpuprovError(f"reservation {held} is in zone {zone}: {why}") from None


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
    from gpuprov.specfile import _plain, load_yaml

    if not os.path.lexists(root / "ansible" / "inventory.yml"):
        return {}
    try:  # the bounded one-pass loader: an alias bomb or deep nesting is refused, not expanded
        data = _plain(load_yaml(root / "ansible" / "inventory.yml"))
    except GpuprovError:
        return {}
    found = data.get("all", {}).get("vars") if isinstance(data, dict) and isinstance(data.get("all"), dict) else None
    return found if isinstance(found, dict) else {}


def preflight(plan: Any, root: Path, *, live: bool = True, run: Runner = run_cli) -> list[Check]:
    if get_target(plan.cluster.cloud).provisioner == "inventory":  # no Terraform values to check
        return [shared_storage_rule(plan, root)]
    ran = live_checks(plan, root, run) if live else [Check(
        "skip", "live checks", "--offline: offerings, reservation, quota and subnet routes are unchecked",
        "run validate without --offline, signed in to the cloud's CLI")]
    rules = unchecked_rows(plan, root, offline_checks(plan, root), ran, live)
    return rules + [shared_storage_rule(plan, root)] + ran


def unchecked_rows(plan: Any, root: Path, rules: list[Check], ran: list[Check], live: bool) -> list[Check]:
    """The quota rule only names the quota to request, and a subnet the user names has routes only a
    live check reads: unless a live row checked them, each is reported skipped, never ok."""
    checked = {c.name for c in ran if c.status in ("ok", "fail")}
    why = "unchecked offline" if not live else "unchecked (no live check ran)"
    out = [Check("skip", c.name, f"{c.detail}: {why}", c.fix)
           if c.name == "quota" and c.status == "ok" and not checked & {"quota (live)", "reservation (live)"} else c
           for c in rules]
    try:
        subnet = settings(plan, root)["subnet"]
    except GpuprovError:
        return out
    if subnet and "subnet (live)" not in checked:
        out.append(Check("skip", "subnet routes", f"{subnet}: its route out (NAT gateway) is {why}",
                         "run validate without --offline, signed in to the cloud's CLI"
                         if get_target(plan.cluster.cloud).live else "check the subnet's route table in the console"))
    return out
