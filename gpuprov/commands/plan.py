"""`gpuprov plan` (the chosen cluster) and `gpuprov explain` (the arithmetic behind it)."""

from __future__ import annotations

import json

import click

from gpuprov.candidates import TABLE_ROWS, layout_label
from gpuprov.catalog.gpus import get_gpu
from gpuprov.catalog.models import get_model
from gpuprov.commands.spec_options import spec_options
from gpuprov.errors import GpuprovError, clip
from gpuprov.host import hosts_left_out
from gpuprov.planner import make_plan
from gpuprov.render.step_terms import step_terms_text
from gpuprov.sizing.throughput import assumptions, flops_per_token
from gpuprov.sizing.time_error import holdout_error
from gpuprov.spot import stale
from gpuprov.storage_cost import undated_prices
from gpuprov.units import GiB, TB, gib


def _plan(spec):
    if spec.capacity_reservation_id or spec.reservation:  # lazy: only a held reservation asks a cloud CLI
        from gpuprov.preflight import locate_reservation

        spec = locate_reservation(spec)
    return make_plan(spec)


def _money(x: float | None) -> str:
    return "n/a (on-prem or unpriced)" if x is None else f"${x:,.0f}"


def _hours(h: float | None) -> str:
    if h is None:
        return "n/a"
    return f"{h:,.1f} h" + (f" ({h / 24:,.1f} days)" if h >= 48 else "")


def _host_lines(plan) -> list[str]:
    """Which of the user's on-prem hosts run the plan and which are left out (the Notes say why)."""
    left = hosts_left_out(plan)
    if not plan.hosts and not left:
        return []
    used = ", ".join(f"{h.name} ({h.address})" for h in plan.hosts or []) or "none"
    lines = [f"  hosts: {used}"]
    if left:
        lines.append(f"  left out ({len(left)} of {len(plan.spec.hosts)} hosts, see Notes): "
                     + ", ".join(f"{h.name} ({h.address})" for h in left))
    return lines


def _fabric_text(plan) -> str:
    if plan.cluster.nodes == 1:
        return "one node: no inter-node fabric (GPUs talk over " + \
            ("NVLink/NVSwitch)" if plan.instance.nvswitch else "the node's own links)")
    assumed = " (assumed: the hosts file states no fabric)" if "fabric" in plan.instance.unknown else ""
    return f"fabric {plan.fabric.name} {plan.fabric.gbps_per_gpu:g} Gb/s per GPU{assumed}"


def _mfu_text(plan) -> str:
    """MFU and where it comes from: the class's assumed utilisation, less recompute and exposed communication."""
    t, c = plan.throughput, plan.cluster
    fl = flops_per_token(get_model(plan.spec.model), c.seq_len, plan.task, plan.model.trainable_params,
                         c.activation_checkpointing)
    recompute = 1 - fl.model / fl.executed if fl.executed else 0.0
    exposed = t.comm_time_s / t.step_time_s if t.step_time_s else 0.0
    fp8 = ""
    if t.float8_gain != 1.0:
        fp8 = (f" in bf16, and float8 linears run their matmuls x{t.float8_gain:.2f} faster"
               " (from the measured step ratio; attention stays bf16)")
    capped = ""
    if t.gpu_power_w is not None and t.gpu_power_w < get_gpu(plan.gpu.slug).tdp_w:
        capped = f" at the {t.gpu_power_w} W power limit"
    return (f"MFU {t.mfu:.1%} (model FLOPs done per second / the GPUs' BF16 peak): the operations it runs "
            f"reach {t.mfu_assumed:.0%} of peak{capped} on average on the work it executes{fp8}; re-running the forward for activation "
            f"checkpointing ({c.activation_checkpointing}) is {recompute:.0%} of that work and counts for nothing, and "
            f"exposed communication is {exposed:.0%} of the step")


def _replica_words(c) -> str:
    """Model states are compared per model replica: HSDP/DDP replicas hold copies, not more states."""
    return "all GPUs" if c.replicate == 1 else f"one replica ({c.replica_gpus} GPUs; {c.replicate} replicas hold copies)"


def _token_count(n: int) -> str:
    """100,000,000 -> 100M; 1.5e10 -> 15B (decimal, as --tokens reads them)."""
    for div, unit in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= div:
            return f"{n / div:,.3g}{unit}"
    return f"{n:,}"


def cost_line(plan) -> str:
    """Steps x step time + start-up (+ preemption on spot) = the hours the cost is computed from."""
    overhead = float(assumptions().raw["run"]["overhead_hours"])
    train_h = plan.training.steps * plan.throughput.step_time_s / 3600.0
    run = plan.run
    parts = ""
    if run is not None and run.checkpoint_hours:
        parts += f" + {_part(run.checkpoint_hours)} checkpoint writes"
    if plan.purchase.option == "spot":
        lost = run.preemption_hours if run is not None else max(0.0, plan.time_hours - train_h - overhead)
        parts += f" + {_part(lost)} expected preemption"
    money = _money(plan.cost_usd)
    if run is not None and run.storage_usd:
        money += f" (storage ${run.storage_usd:,.2f})"
    step_s = plan.throughput.step_time_s
    step = f"{step_s:,.2f}" if step_s >= 1 else f"{step_s:.4f}"  # enough digits that steps x step adds up
    return (f"{plan.training.steps:,} optimizer steps x {step} s = {train_h:,.2f} h "
            f"+ {overhead:g} h start-up{parts} = {_hours(plan.time_hours)}{_range_text(plan)}, {money}")


def _range_text(plan) -> str:
    """The hours the model's error on its hold-out spans (gpuprov/sizing/time_error.py)."""
    if not plan.time_hours_range:
        return ""
    low, high = plan.time_hours_range
    e = holdout_error()
    return (f" (measured runs: {low:,.1f}-{high:,.1f} h; the time model's error on {e['rows']} held-out runs "
            f"spans {e['worst_under_pct']:+g}% to {e['worst_over_pct']:+g}%)")


def _part(hours: float) -> str:
    return f"{hours:,.2f} h" if hours >= 0.005 else f"{hours * 60:,.1f} min"


def price_warnings(plan, today=None) -> list[str]:
    """A price older than the limit (or undated) is flagged where the user reads it (CLI output only:
    the bundle must not change with the calendar)."""
    if plan.instance.cloud == "onprem" or plan.instance.price_per_hour_usd is None:
        return []
    out = []
    why = stale(plan.instance.price_date, today)
    if why is not None:
        out.append(f"the {plan.purchase.option} price ${plan.instance.price_per_hour_usd:,.2f}/h is {why}: check the "
                   f"current rate ({clip(plan.instance.source.split('; price: ')[-1], 160)})")
    kind = plan.shared_storage.kind if plan.shared_storage else None
    for what, date, source in undated_prices(plan.instance.cloud, kind):
        why = stale(date, today)
        if why is not None:
            out.append(f"the {what} in the cost is {why}: check it ({source.split(' (')[0]})")
    return out


def _gpus_x_nodes(r) -> str:
    return f"{r.gpus_per_node} x {r.nodes}"


def _table_hours(r) -> str:
    if not r.time_hours_range:
        return f"{r.time_hours:,.1f}"
    return f"{r.time_hours:,.1f} ({r.time_hours_range[0]:,.1f}-{r.time_hours_range[1]:,.1f})"


def candidates_table(plan) -> list[str]:
    """The compact table: the best layout per GPU type on each cloud, ranked by the objective."""
    rows = plan.candidates
    if not rows:
        return []
    head = ("", "cloud", "region", "instance", "GPU", "GPUs x nodes", "layout", "purchase", "$/h", "hours",
            "total $", "MFU", "mem margin")
    body = []
    for r in rows[:TABLE_ROWS]:
        margin = 1 - r.per_gpu_bytes / r.gpu_memory_bytes
        body.append(("*" if r.chosen else "", r.cloud, r.region or "-", r.instance_type, r.gpu, _gpus_x_nodes(r),
                     r.layout, r.purchase, "-" if r.price_per_hour_usd is None else f"{r.price_per_hour_usd:,.2f}",
                     _table_hours(r), "-" if r.cost_usd is None else f"{r.cost_usd:,.0f}",
                     f"{r.mfu:.1%}", f"{margin:.0%}"))
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    right = {8, 9, 10, 11, 12}

    def line(cells) -> str:
        return "  " + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                                for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    more = len(rows) - TABLE_ROWS
    title = (f"Candidates (best per GPU type on each cloud, ranked by {plan.spec.objective}; * chosen; "
             f"mem margin: GPU memory free at the peak):")
    return [title, line(head), *map(line, body)] + (
        [f"  ... {more} more in --json"] if more > 0 else []) + [""]


def render_plan(plan) -> str:
    s, c, m, t, i = plan.spec, plan.cluster, plan.memory, plan.throughput, plan.instance
    out: list[str] = []
    task = {"full": "full training", "lora": f"LoRA r={s.lora_rank}", "qlora": f"QLoRA r={s.lora_rank}"}[plan.task]
    how = "from scratch" if getattr(s, "init", "pretrained") == "random" else "fine-tuning the pretrained weights"
    out.append(f"{plan.model.display_name} ({plan.model.params / 1e9:.2f}B params, {plan.model.trainable_params:,} "
               f"trainable), {task}, {how}, {_token_count(s.tokens)} tokens in {plan.training.steps:,} optimizer "
               f"steps of {c.global_batch_tokens // c.seq_len:,} x {c.seq_len} tokens, objective: {s.objective}")
    out.append("")
    where = f"{i.cloud}" + (f" {c.region}" if c.region else "") + (f", {plan.purchase.option}" if i.cloud != "onprem" else "")
    out.append(f"Chosen: {c.nodes} x {c.instance_type} ({where}) = {c.total_gpus} x {plan.gpu.name}")

    # one name for the layout everywhere (the table, generate's summary, README, topology.svg)
    layout = layout_label(c.sharding, c.replica_gpus, c.total_gpus, c.tp, c.cp, c.pp)
    out.append(f"  layout {layout}, activation checkpointing {c.activation_checkpointing}, "
               f"micro-batch {c.micro_batch}, grad accumulation {c.grad_accum}, global batch "
               f"{c.global_batch_tokens:,} tokens")
    out.append(f"  {_fabric_text(plan)}; software: driver "
               f"{plan.software.driver_branch}, CUDA {plan.software.cuda_version}, NCCL {plan.software.nccl_version}"
               + (f"; image profile {plan.software.image_profile.name}" if plan.software.image_profile else ""))
    out.extend(_host_lines(plan))
    out.extend(f"  WARNING: {w}" for w in [*plan.warnings, *price_warnings(plan)])
    out.append("")
    out.extend(candidates_table(plan))
    out.append("Memory per GPU (GiB = 2**30 bytes):")
    width = max(len(k) for k in m.breakdown) if m.breakdown else 10
    for term, b in m.breakdown.items():
        if b:  # terms this setup does not have (e.g. fp32 master under FSDP2) stay in --json
            out.append(f"  {term:<{width}}  {b / GiB:10,.2f}")
    usable = m.gpu_memory_bytes * (1 - m.safety_margin)
    out.append(f"  {'total':<{width}}  {m.per_gpu_bytes / GiB:10,.2f}  of {m.gpu_memory_bytes / GiB:,.1f} GiB "
               f"({usable / GiB:,.1f} usable at {m.safety_margin:.0%} margin; headroom {m.headroom_bytes / GiB:,.1f})")
    out.append(f"  model states, {_replica_words(c)}: {gib(m.model_states_bytes // c.replicate)}; the 18 B/param rule "
               f"of thumb (mixed-precision Adam): {gib(m.rule_of_thumb_bytes)}")
    out.append("")
    out.append("Time and cost:")
    out.append(f"  {t.tokens_per_s:,.0f} tokens/s on the cluster; step {t.step_time_s:,.2f} s = compute "
               f"{t.compute_time_s:,.2f} s + communication compute cannot hide {t.comm_time_s:,.2f} s ({t.bound}-bound)")
    if t.step_terms_s:
        out.append(f"  step by operation: {step_terms_text(t.step_terms_s)}")
    out.append(f"  {_mfu_text(plan)}")
    price = "" if i.price_per_hour_usd is None else \
        f" at ${i.price_per_hour_usd:,.2f}/h per node ({i.price_date or 'undated'})"
    out.append(f"  {cost_line(plan)}{price}")
    deadline = f"deadline {s.deadline_hours:g} h" if s.deadline_hours else ""
    budget = f"budget ${s.budget_usd:,.0f}" if s.budget_usd else ""
    if deadline or budget:
        out.append("  within " + ", ".join(x for x in (deadline, budget) if x))
    out.append("")
    out.append("Host checklist (one node):")
    for chk in plan.host.checks:
        mark = "unknown" if not chk.known else "ok" if chk.ok else "SHORT"
        out.append(f"  [{mark}] {chk.rule}: need {chk.required}; have {chk.actual}")
    raid = (f"local NVMe unknown (the RAID0 role uses the drives it finds) at {plan.storage.mount_point}"
            if "nvme" in i.unknown else f"local NVMe RAID0 {plan.storage.devices} x "
            f"{i.local_nvme_bytes_each / TB:,.2f} TB at {plan.storage.mount_point}")
    out.append(f"  one full-state checkpoint: {plan.host.checkpoint_bytes / TB:,.2f} TB; keeping "
               f"{plan.host.checkpoints_kept}; {raid}")
    if plan.host.bill_of_materials:
        out.append("")
        out.append("Bill of materials (per node):")
        out.extend(f"  - {line}" for line in plan.host.bill_of_materials)
    if plan.alternatives:
        out.append("")
        out.append("Alternatives (best per GPU type) and why they lost:")
        for a in plan.alternatives:
            what = f"{a.nodes} x {a.instance_type} ({a.cloud}, {a.total_gpus} GPUs, {a.sharding})"
            cost = "" if a.cost_usd is None else f", {_money(a.cost_usd)}"
            time = "" if a.time_hours is None else f", {_hours(a.time_hours)}"
            out.append(f"  {a.gpu:<18} {what}{time}{cost}: {a.reason}")
    if plan.notes:
        out.append("")
        out.append("Notes:")
        out.extend(f"  - {n}" for n in plan.notes)
    return "\n".join(out)


@click.command()
@spec_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object")
@click.option("--svg", "svg_dir", metavar="DIR", default=None,
              help="Also write the plan's pictures (topology.svg, memory.svg, cost.svg) into DIR")
def plan(spec, as_json: bool, svg_dir: str | None) -> None:
    """Choose GPU type, instance, node count and sharding for the cheapest run that fits.

    \b
    gpuprov plan --model 70b --tokens 20B
    gpuprov plan --model llama-3.1-8b --tokens 1B --deadline 2d --cloud gcp
    gpuprov plan --model llama-3.1-8b --task lora --tokens 200M --gpus 2 --json
    gpuprov plan --model 70b --tokens 1B --hosts hosts.yaml   # on-prem (gpu:/gpus: per host)
    gpuprov plan --model 70b --deadline 30d --budget 50000 --objective time
    gpuprov plan --model 70b --tokens 20B --svg pictures/   # memory by term, cost against hours
    """
    if svg_dir is not None:
        _check_svg_dir(svg_dir)
    result = _plan(spec)
    if svg_dir is not None:
        _write_pictures(result, svg_dir)
    if as_json:
        click.echo(json.dumps(result.model_dump(mode="json"), indent=2))
    else:
        click.echo(render_plan(result))


def _check_svg_dir(path: str) -> None:
    """Refused before planning: an empty name, a control character, or something that is not a folder."""
    from pathlib import Path

    from gpuprov.validators import safe_text

    if not path.strip():
        raise GpuprovError("--svg is empty: give the folder the pictures go in (e.g. --svg pictures/)")
    try:
        safe_text(path, "--svg")
    except ValueError as exc:
        raise GpuprovError(f"{exc}; choose a plain folder name") from None
    if Path(path).exists() and not Path(path).is_dir():
        raise GpuprovError(f"--svg {path}: not a folder")


def _write_pictures(plan, path: str) -> None:
    """The bundle's pictures, each written whole (a fresh file renamed over the old one)."""
    from pathlib import Path

    from gpuprov.render.charts import render_pictures
    from gpuprov.safefile import write_atomic

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in render_pictures(plan).items():
        write_atomic(folder / name, text)
    click.echo(f"wrote {', '.join(render_pictures(plan))} to {path}", err=True)


@click.command()
@spec_options
@click.option("--json", "as_json", is_flag=True, help="Print the numbers as one JSON object (README: JSON output)")
def explain(spec, as_json: bool) -> None:
    """Show the arithmetic behind a plan, term by term, beside the 18 B/param rule of thumb.

    \b
    gpuprov explain --model 70b --tokens 20B
    gpuprov explain -f gpuprov.yaml
    gpuprov explain --model 8b --task lora --json
    """
    from gpuprov.render.explain import explain_data, render_explain  # lazy: plan does not print the arithmetic

    if as_json:
        click.echo(json.dumps(explain_data(spec, _plan(spec)), indent=2))
        return
    click.echo(render_explain(spec, _plan(spec)))
