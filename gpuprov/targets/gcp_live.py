"""GCP's live checks for `gpuprov validate` (the gcloud CLI, answers parsed as it prints them):
the machine type's zones, the reservation, the GPU quota. gpuprov/targets/gcp.py names them; imported
when validate runs them (they read the catalog, which reads the target registry)."""

from __future__ import annotations

import shlex
from typing import Any

from gpuprov.catalog import bringup as cat
from gpuprov.catalog.instances import get_instance
from gpuprov.targets.gcp import TARGET
from gpuprov.targets.live import Check, LiveCheck, Runner, cli_json, offered_in


def checks(s: dict) -> list[LiveCheck]:
    """The checks that apply to these settings (terraform.tfvars over the plan's defaults)."""
    found: list[LiveCheck] = [offerings]
    if s["purchase"] in ("reservation", "capacity-block") and s["held"]:
        found.append(reservation)
    return [*found, quota]


def offerings(plan: Any, s: dict, run: Runner) -> Check:
    argv = ["gcloud", "compute", "machine-types", "list", f"--filter=name={s['instance']}", "--format=json"]
    if s["project"]:
        argv.append(f"--project={s['project']}")
    data = cli_json(run, argv)
    if data is None:
        return Check("fail", "offered (live)", "machine-types list failed", shlex.join(argv))
    zones = sorted(m["zone"].rsplit("/", 1)[-1] for m in data if m["zone"].rsplit("/", 1)[-1].startswith(s["region"] + "-"))
    return offered_in(s, zones, "machine type", "set zone in terraform/terraform.tfvars to one of them")


def _find_reservation(held: str, run: Runner) -> tuple[dict | None, list[str]]:
    """The reservation `held` (a name, projects/P/reservations/R, or with /reservationBlocks/B) in
    whichever zone it lives, as `gcloud compute reservations list` prints it; and the command."""
    parts = held.split("/")
    name = parts[3] if held.startswith("projects/") else parts[0]
    argv = ["gcloud", "compute", "reservations", "list", f"--filter=name={name}", "--format=json"]
    if held.startswith("projects/"):
        argv.append(f"--project={parts[1]}")
    found = [r for r in cli_json(run, argv) or [] if isinstance(r, dict) and r.get("name") == name]
    return (found[0] if found else None), argv


def held_zone(held: str, run: Runner) -> str | None:
    """The zone reservation `held` lives in (None: the CLI does not know it)."""
    data, _ = _find_reservation(held, run)
    zone = data.get("zone") if data else None
    return zone.rsplit("/", 1)[-1] if isinstance(zone, str) else None


def reservation(plan: Any, s: dict, run: Runner) -> Check:
    data, argv = _find_reservation(s["held"], run)
    name = data.get("name") if data else s["held"]
    if not data:
        return Check("fail", "reservation (live)", f"reservation {name} not found", shlex.join(argv))
    where = str(data.get("zone", "")).rsplit("/", 1)[-1]
    if s["zone"] and where != s["zone"]:
        return Check("fail", "reservation (live)", f"{name} is in {where}, zone is {s['zone']}",
                     f"set zone = \"{where}\" in terraform/terraform.tfvars (or generate with --zone {where})")
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
        return Check("fail", "reservation (live)", f"{name}: " + "; ".join(problems), shlex.join(argv))
    return Check("ok", "reservation (live)", f"{name}: {free} x {s['instance']} free in {where}")


def quota(plan: Any, s: dict, run: Runner) -> Check:
    inst = get_instance(s["instance"])
    entry = cat.quota("gcp") or {"metrics": {}}
    metric = entry["metrics"].get(TARGET.quota_family(inst.name))
    if metric is None:
        return Check("skip", "quota (live)", f"no quota metric for {inst.name}")
    if s["purchase"] in ("spot", "flex-start"):
        metric = entry["preemptible_prefix"] + metric
    argv = ["gcloud", "compute", "regions", "describe", s["region"], "--format=json"]
    data = cli_json(run, argv)
    if data is None:
        return Check("fail", "quota (live)", "regions describe failed", shlex.join(argv))
    row = next((q for q in data.get("quotas", []) if q.get("metric") == metric), None)
    need = s["nodes"] * inst.gpus
    if row is None or float(row["limit"]) - float(row.get("usage", 0)) < need:
        have = 0 if row is None else float(row["limit"]) - float(row.get("usage", 0))
        return Check("fail", "quota (live)", f"{metric}: {have:.0f} GPUs free in {s['region']}, the plan needs {need}",
                     "request more at https://console.cloud.google.com/iam-admin/quotas "
                     f"(metric {metric}, region {s['region']})")
    return Check("ok", "quota (live)", f"{metric}: {float(row['limit']) - float(row.get('usage', 0)):.0f} free >= {need}")
