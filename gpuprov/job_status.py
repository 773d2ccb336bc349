"""What `gpuprov status` reports: the job's state from the scheduler (or the process), the newest
step, loss, tokens/s and MFU from the metrics file the trainer writes (one JSON line per logged
step, launch/train.py's Metrics), and the plan's predicted figures beside them. Pure parsing here;
commands/status.py fetches the text (locally, or from the first node over Ansible).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

TAIL_BYTES = 256 * 1024  # enough for the newest few hundred records of a long run
SEPARATOR = "---gpuprov-metrics---"
JOBCOMP_SEPARATOR = "---gpuprov-jobcomp---"  # then the job's newest jobcomp/filetxt record, if any


def parse_scontrol(text: str) -> dict[str, str]:
    """`scontrol show job --oneliner ID` as a dict; {"JobState": "GONE"} once Slurm forgot the job."""
    fields = dict(f.split("=", 1) for f in text.split() if "=" in f)
    if "JobState" not in fields:
        return {"JobState": "GONE", "Reason": "no longer listed by slurmctld (it ended more than MinJobAge ago)"}
    return fields


def parse_jobcomp(text: str, job_id: str) -> dict[str, str] | None:
    """The newest jobcomp/filetxt record of this job (one `Key=value ...` line per ended run)."""
    found = None
    for line in text.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("JobId") == job_id and "JobState" in fields:
            found = fields
    return found


def job_summary(kind: str, text: str) -> dict[str, Any]:
    if kind == "slurm":
        live, _, comp = text.partition(JOBCOMP_SEPARATOR)
        f = parse_scontrol(live)
        job_id = next((w.split("=", 1)[1] for w in comp.split() if w.startswith("JobId=")), "")
        record = parse_jobcomp(comp, job_id) if f["JobState"] == "GONE" and job_id else None
        if record:  # slurmctld forgot the job; its completion record did not
            return {"state": record["JobState"], "restarts": None, "nodes": record.get("NodeList"),
                    "run_time": None, "reason": f"ended {record.get('EndTime', '?')}, exit code "
                                                f"{record.get('ExitCode', '?')} (job completion record)"}
        return {"state": f["JobState"], "restarts": int(f.get("Restarts", "0") or 0), "nodes": f.get("NodeList"),
                "run_time": f.get("RunTime"), "reason": f.get("Reason") if f.get("Reason") not in (None, "None") else None}
    alive = text.strip() not in ("", "exited")
    return {"state": "RUNNING" if alive else "EXITED", "restarts": 0, "nodes": None, "run_time": None, "reason": None}


def parse_metrics(text: str) -> dict[str, Any]:
    """The newest start, step and end records of the metrics text (a torn last line is skipped)."""
    latest: dict[str, Any] = {"starts": 0, "start": None, "step": None, "end": None, "val_loss": None}
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        if rec.get("event") == "start":
            latest.update(starts=latest["starts"] + 1, start=rec, end=None)
        elif rec.get("event") == "end":
            latest["end"] = rec
        elif "loss" in rec and "step" in rec:
            latest["step"] = rec
        elif "val_loss" in rec:
            latest["val_loss"] = rec["val_loss"]
    return latest


def read_tail(path: Path) -> str:
    """The end of a local metrics file ('' when there is none yet); only a regular file is read."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return ""
    if not stat.S_ISREG(st.st_mode):
        return ""
    with open(path, "rb") as handle:
        handle.seek(max(0, st.st_size - TAIL_BYTES))
        return handle.read(TAIL_BYTES).decode("utf-8", errors="replace")


def report(plan: Any, job_id: str, kind: str, job: dict[str, Any], metrics: dict[str, Any]) -> dict[str, Any]:
    step = metrics["step"] or {}
    return {
        "job": {"id": job_id, "kind": kind, **job},
        "step": step.get("step"), "steps": plan.training.steps, "loss": step.get("loss"),
        "val_loss": metrics["val_loss"], "tokens_per_s": step.get("tokens_per_s"), "mfu": step.get("mfu"),
        "finished": metrics["end"] is not None, "starts": metrics["starts"],
        "resumed_at": (metrics["start"] or {}).get("step") or None,
        "plan": {"tokens_per_s": plan.throughput.tokens_per_s, "mfu": plan.throughput.mfu,
                 "step_time_s": plan.throughput.step_time_s, "time_hours": plan.time_hours},
    }


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def lines(r: dict[str, Any]) -> list[str]:
    j = r["job"]
    head = f"job {j['id']} ({'Slurm' if j['kind'] == 'slurm' else 'train.sh'}): {j['state']}"
    head += "".join([f" {j['run_time']}" if j.get("run_time") else "", f" on {j['nodes']}" if j.get("nodes") else "",
                     f", requeued {j['restarts']}x" if j.get("restarts") else "",
                     f" ({j['reason']})" if j.get("reason") else ""])
    out = [head]
    if r["step"] is None:
        out.append("no step logged yet" + (" (the trainer is starting)" if j["state"] == "RUNNING" else ""))
        return out
    pct = 100 * r["step"] / r["steps"] if r["steps"] else 0
    resumed = f", resumed at step {r['resumed_at']}" if r["resumed_at"] else ""
    out.append(f"step {r['step']:,} of {r['steps']:,} ({pct:.1f}%){resumed}{', finished' if r['finished'] else ''}")
    out.append(f"loss        {_num(r['loss'], '.4f')}" + (f"  (validation {r['val_loss']:.4f})" if r["val_loss"] else ""))
    p = r["plan"]
    out.append(f"tokens/s    {_num(r['tokens_per_s'], ',.0f'):>12}   plan {p['tokens_per_s']:,.0f}")
    mfu = None if r["mfu"] is None else 100 * r["mfu"]
    out.append(f"MFU         {_num(mfu, '.1f') + '%':>12}   plan {100 * p['mfu']:.1f}%")
    return out
