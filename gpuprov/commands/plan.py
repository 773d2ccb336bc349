"""`gpuprov plan` (the chosen cluster) and `gpuprov explain` (the arithmetic behind it)."""

from __future__ import annotations

import json

import click

from gpuprov.commands.spec_options import spec_options

GiB = 2**30
TB = 10**12


def _plan(spec):
    from gpuprov.planner import make_plan

    return make_plan(spec)


def _gib(b: float) -> str:
    return f"{b / GiB:,.1f} GiB"


def _money(x: float | None) -> str:
    return "n/a (on-prem or unpriced)" if x is None else f"${x:,.0f}"


def _hours(h: float | None) -> str:
    if h is None:
        return "n/a"
    return f"{h:,.1f} h" + (f" ({h / 24:,.1f} days)" if h >= 48 else "")


def _host_lines(plan) -> list[str]:
    """Which of the user's on-prem hosts run the plan and which are left out (the Notes say why)."""
    from gpuprov.host import hosts_left_out

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
    return f"fabric {plan.fabric.name} {plan.fabric.gbps_per_gpu:g} Gb/s per GPU"


def _mfu_text(plan) -> str:
    """MFU and where it comes from: the class's assumed utilisation, less recompute and exposed communication."""
    from gpuprov.sizing.throughput import flops_per_token
    from gpuprov.catalog.models import get_model

    t, c = plan.throughput, plan.cluster
    fl = flops_per_token(get_model(plan.spec.model), c.seq_len, plan.task, plan.model.trainable_params,
                         c.activation_checkpointing)
    recompute = 1 - fl.model / fl.executed if fl.executed else 0.0
    exposed = t.comm_time_s / t.step_time_s if t.step_time_s else 0.0
    fp8 = ""
    if t.float8_gain != 1.0:
        fp8 = f" in bf16, and float8 linears run it x{t.float8_gain:.2f} faster (measured ratio)"
    return (f"MFU {t.mfu:.1%} (model FLOPs done per second / the GPUs' BF16 peak): this GPU class is assumed to "
            f"reach {t.mfu_assumed:.0%} of peak on the work it executes{fp8}; re-running the forward for activation "
            f"checkpointing ({c.activation_checkpointing}) is {recompute:.0%} of that work and counts for nothing, and "
            f"exposed communication is {exposed:.0%} of the step")


def _gpus_x_nodes(r) -> str:
    return f"{r.gpus_per_node} x {r.nodes}"


def candidates_table(plan) -> list[str]:
    """The compact table: the best layout per GPU type on each cloud, ranked by the objective."""
    from gpuprov.candidates import TABLE_ROWS

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
                     f"{r.time_hours:,.1f}", "-" if r.cost_usd is None else f"{r.cost_usd:,.0f}",
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
    out.append(f"{plan.model.display_name} ({plan.model.params / 1e9:.2f}B params, {plan.model.trainable_params:,} "
               f"trainable), {task}, {s.tokens / 1e9:,.2f}B tokens, seq {s.seq_len}, objective: {s.objective}")
    out.append("")
    where = f"{i.cloud}" + (f" {c.region}" if c.region else "") + (f", {plan.purchase.option}" if i.cloud != "onprem" else "")
    out.append(f"Chosen: {c.nodes} x {c.instance_type} ({where}) = {c.total_gpus} x {plan.gpu.name}")
    sg = f"shard group {c.shard_group}, {c.replicate} replica(s)" if c.sharding in ("fsdp", "hsdp", "zero2") else \
        f"{c.replicate} replica(s)"
    if c.tp * c.cp * c.pp > 1:
        dp = c.total_gpus // (c.tp * c.cp * c.pp)
        out.append(f"  layout: tensor parallel {c.tp} (inside each node, NVLink) x context parallel {c.cp} x "
                   f"data parallel {dp} ({c.sharding} over dp x cp)")
    out.append(f"  sharding {c.sharding} ({sg}), activation checkpointing {c.activation_checkpointing}, "
               f"micro-batch {c.micro_batch}, grad accumulation {c.grad_accum}, global batch "
               f"{c.global_batch_tokens:,} tokens")
    out.append(f"  {_fabric_text(plan)}; software: driver "
               f"{plan.software.driver_branch}, CUDA {plan.software.cuda_version}, NCCL {plan.software.nccl_version}"
               + (f"; image profile {plan.software.image_profile.name}" if plan.software.image_profile else ""))
    out.extend(_host_lines(plan))
    out.extend(f"  WARNING: {w}" for w in plan.warnings)
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
    out.append(f"  model states, all GPUs: {_gib(m.model_states_bytes)}; the 18 B/param rule of thumb (mixed-precision Adam): "
               f"{_gib(m.rule_of_thumb_bytes)}")
    out.append("")
    out.append("Time and cost:")
    out.append(f"  {t.tokens_per_s:,.0f} tokens/s on the cluster; step {t.step_time_s:,.2f} s = compute "
               f"{t.compute_time_s:,.2f} s + communication compute cannot hide {t.comm_time_s:,.2f} s ({t.bound}-bound)")
    out.append(f"  {_mfu_text(plan)}")
    price = "" if i.price_per_hour_usd is None else f" at ${i.price_per_hour_usd:,.2f}/h per node ({i.price_date})"
    out.append(f"  {plan.training.steps:,} steps, {_hours(plan.time_hours)}, {_money(plan.cost_usd)}{price}")
    deadline = f"deadline {s.deadline_hours:g} h" if s.deadline_hours else ""
    budget = f"budget ${s.budget_usd:,.0f}" if s.budget_usd else ""
    if deadline or budget:
        out.append("  within " + ", ".join(x for x in (deadline, budget) if x))
    out.append("")
    out.append("Host checklist (one node):")
    for chk in plan.host.checks:
        mark = "ok  " if chk.ok else "SHORT"
        out.append(f"  [{mark}] {chk.rule}: need {chk.required}; have {chk.actual}")
    out.append(f"  one full-state checkpoint: {plan.host.checkpoint_bytes / TB:,.2f} TB; keeping "
               f"{plan.host.checkpoints_kept}; local NVMe RAID0 {plan.storage.devices} x "
               f"{i.local_nvme_bytes_each / TB:,.2f} TB at {plan.storage.mount_point}")
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
def plan(spec, as_json: bool) -> None:
    """Choose GPU type, instance, node count and sharding for the cheapest run that fits.

    \b
    gpuprov plan --model 70b --tokens 20B
    gpuprov plan --model llama-3.1-8b --tokens 1B --deadline 2d --cloud gcp
    gpuprov plan --model llama-3.1-8b --task lora --tokens 200M --gpus 2 --json
    gpuprov plan --model 70b --tokens 1B --hosts hosts.yaml   # on-prem (gpu:/gpus: per host)
    gpuprov plan --model 70b --deadline 30d --budget 50000 --objective time
    """
    result = _plan(spec)
    if as_json:
        click.echo(json.dumps(result.model_dump(mode="json"), indent=2))
    else:
        click.echo(render_plan(result))


@click.command()
@spec_options
def explain(spec) -> None:
    """Show the arithmetic behind a plan, term by term, beside the 18 B/param rule of thumb.

    \b
    gpuprov explain --model 70b --tokens 20B
    gpuprov explain -f gpuprov.yaml
    """
    click.echo(render_explain(spec, _plan(spec)))


def _float8_kw(plan, arch) -> dict:
    """The step estimate's float8 arguments, as the planner passed them (the Plan's gain)."""
    if plan.throughput.float8_gain == 1.0:
        return {}
    return {"float8_gain": plan.throughput.float8_gain, "float8_params": arch.num_layers * arch.layer_linear_params()}


def render_explain(spec, plan) -> str:
    """The plan's arithmetic, term by term; the 18 B/param rule of thumb beside the model states."""
    from gpuprov.catalog.gpus import get_gpu
    from gpuprov.catalog.models import get_model
    from gpuprov.sizing.throughput import (
        LayerShape, Shape, assumptions, flops_per_token, inter_node_gbytes, intra_node_gbytes, layout_step_estimate,
    )

    a = assumptions()
    arch = get_model(spec.model)
    gpu = get_gpu(plan.gpu.slug)
    c, m, t = plan.cluster, plan.memory, plan.throughput
    n_params, trainable = plan.model.params, plan.model.trainable_params
    L, d, s = arch.num_layers, arch.num_attention_heads * arch.head_dim, c.seq_len
    fl = flops_per_token(arch, s, plan.task, trainable, c.activation_checkpointing)
    intra, link = intra_node_gbytes(gpu)
    inter = inter_node_gbytes(plan.fabric.name, plan.fabric.gbps_per_gpu) if c.nodes > 1 else 0.0
    shape = Shape(nodes=c.nodes, gpus_per_node=c.gpus_per_node, sharding=c.sharding, shard_group=c.shard_group,
                  micro_batch=c.micro_batch, grad_accum=c.grad_accum, seq_len=s)
    layer = LayerShape(L, arch.hidden_size, arch.q_dim if arch.num_kv_heads < arch.num_attention_heads else arch.kv_dim)
    st = layout_step_estimate(shape=shape, tp=c.tp, cp=c.cp, layer=layer, ac=c.activation_checkpointing,
                       flops=fl, peak_tflops=gpu.bf16_tflops, util=t.mfu_assumed,
                       hbm_gbytes_per_s=gpu.hbm_gbytes_per_s, intra_gbytes=intra, inter_gbytes=inter or intra,
                       params=n_params, trainable=trainable, num_layers=L, task=plan.task, optimizer=c.optimizer,
                       precision=c.precision, offload=c.offload, pcie_gen=gpu.pcie_gen, **_float8_kw(plan, arch))
    out: list[str] = []
    w = out.append
    w(f"== {plan.model.display_name}: {c.nodes} x {c.instance_type}, {c.total_gpus} x {gpu.slug}, {c.sharding}, "
      f"AC {c.activation_checkpointing}, micro-batch {c.micro_batch}")
    w("")
    w("1. Parameters (exact, from the config)")
    w(f"   N = {n_params:,}   trainable = {trainable:,}   matmul params (no input embedding) = {fl.matmul_params:,}")
    w("")
    w("2. Memory per GPU (estimator terms)                         GiB")
    for term, b in m.breakdown.items():
        if b:
            w(f"   {term:<55}{b / GiB:10,.2f}")
    w(f"   {'= per-GPU peak':<55}{m.per_gpu_bytes / GiB:10,.2f}")
    usable = m.gpu_memory_bytes * (1 - m.safety_margin)
    w(f"   usable = {m.gpu_memory_bytes / GiB:,.2f} GiB x (1 - {m.safety_margin:g}) = {usable / GiB:,.2f} GiB -> "
      f"headroom {m.headroom_bytes / GiB:,.2f} GiB")
    w(f"   model states, all GPUs (weights + grads + optimizer) = {m.model_states_bytes / GiB:,.1f} GiB"
      f"   | rule of thumb: 18 B x N = {m.rule_of_thumb_bytes / GiB:,.1f} GiB "
      f"({(m.model_states_bytes - m.rule_of_thumb_bytes) / m.rule_of_thumb_bytes:+.1%})")
    node_mem = gpu.memory_bytes * c.gpus_per_node
    w(f"   one node holds {c.gpus_per_node} x {gpu.memory_bytes / GiB:,.1f} GiB = {node_mem / GiB:,.1f} GiB of GPU "
      f"memory; the rule of thumb {'fits' if m.rule_of_thumb_bytes <= node_mem else 'does NOT fit'} in it")
    w("")
    w("3. FLOPs per token (PaLM appendix B)")
    if plan.task == "full":
        w(f"   6 x N_matmul            = 6 x {fl.matmul_params:,} = {6 * fl.matmul_params:.4g}")
    else:
        w(f"   4 x N_matmul + 6 x N_lora = 4 x {fl.matmul_params:,} + 6 x {trainable:,} = "
          f"{4 * fl.matmul_params + 6 * trainable:.4g}")
    w(f"   attention 12 x L x s x d = 12 x {L} x {s} x {d} = {fl.attention:.4g}")
    w(f"   model FLOPs (MFU counts) = {fl.model:.4g}   | rule of thumb 6N = {6 * n_params:.4g}")
    w(f"   recompute ({c.activation_checkpointing}) = {fl.recompute:.4g}  -> executed = {fl.executed:.4g}")
    w("")
    w("4. Compute")
    peak = gpu.bf16_tflops
    w(f"   GPU dense BF16 peak {peak:g} TFLOPS x assumed utilisation {t.mfu_assumed:.2f} ({t.mfu_source})")
    if plan.task == "qlora":
        w(f"   x QLoRA dequantisation factor {a.qlora_factor:g} ({a.qlora_source})")
    cmb = st.terms["compute_per_micro_batch_s"]
    split = f" / (tp {c.tp} x cp {c.cp})" if c.tp * c.cp > 1 else ""
    w(f"   per micro-batch: {c.micro_batch} x {s} tokens x {fl.executed:.4g} / ({peak:g}e12 x {st.utilisation:.3f}){split} "
      f"= {cmb:,.3f} s")
    w("")
    w("5. Communication per GPU")
    w(f"   inside a node: {link} at {intra:,.0f} GB/s achievable; across nodes: {plan.fabric.name} "
      f"{plan.fabric.gbps_per_gpu:g} Gb/s per GPU -> {inter:,.1f} GB/s achievable" if c.nodes > 1 else
      f"   inside a node: {link} at {intra:,.0f} GB/s achievable (single node: no fabric)")
    if c.sharding in ("fsdp", "hsdp"):
        g = c.shard_group // c.tp  # FSDP runs over dp x cp; each rank gathers its TP shard (1/tp)
        if plan.task == "full":
            gathers = f"{a.param_gather_bytes:g} B"
            if t.float8_gain != 1.0:  # the blocks' linears travel as float8
                gathers = f"{a.f8_gather_bytes:g} B (block linears, float8) or {a.param_gather_bytes:g} B"
            what = f"(2 all-gathers x {gathers} + reduce-scatter {a.grad_reduce_bytes:g} B) per parameter"
        else:
            base = a.qlora_gather_bytes if plan.task == "qlora" else a.param_gather_bytes
            what = (f"(2 all-gathers of the frozen base x {base:g} B/param + reduce-scatter of the adapter "
                    f"grads x {a.grad_reduce_bytes:g} B/param)")
        w(f"   per micro-batch over the shard group of {g}: (g-1)/g x {what} = "
          f"{st.terms['comm_per_micro_batch_s']:,.3f} s")
        if c.sharding == "hsdp":
            w(f"   per step across {c.replicate} replicas: all-reduce of the grad shard = {st.terms['sync_per_step_s']:,.3f} s")
    elif c.sharding == "zero2":
        w(f"   per micro-batch reduce-scatter of grads = {st.terms['comm_per_micro_batch_s']:,.3f} s; after the step "
          f"all-gather of params = {st.terms['tail_s']:,.3f} s (not hidden)")
    elif c.sharding == "ddp":
        w(f"   once per step all-reduce of {a.grad_reduce_bytes:g} B/param grads = {st.terms['sync_per_step_s']:,.3f} s")
    else:
        w("   single GPU: none")
    if c.tp > 1:
        w(f"   tensor parallel {c.tp} (Megatron-LM sec. 3: 2 all-reduces forward + 2 backward per layer, + recompute;"
          f" SP splits each into reduce-scatter + all-gather) on {link}: {st.terms['tp_comm_per_micro_batch_s']:,.3f} s"
          " per micro-batch, not hidden (the next matmul waits for it)")
    if c.cp > 1:
        w(f"   context parallel {c.cp} ring (K/V forward, K/V + fp32 dK/dV backward, cp-1 hops per layer): "
          f"{st.terms['cp_ring_per_micro_batch_s']:,.3f} s per micro-batch, exposed "
          f"{st.terms['cp_exposed_per_micro_batch_s']:,.3f} s")
    w(f"   compute hides {a.overlap:.0%} of the per-micro-batch communication (it runs while the GPUs compute); "
      f"what is left waits: {st.terms['exposed_per_micro_batch_s']:,.3f} s per micro-batch, "
      f"{st.terms['exposed_sync_s']:,.3f} s for the per-step sync")
    w(f"   total per GPU per step: {st.comm_bytes_per_gpu / 1e9:,.2f} GB")
    w("")
    w("6. Step, time and cost")
    w(f"   step = {c.grad_accum} x ({cmb:,.3f} + {st.terms['exposed_per_micro_batch_s']:,.3f}) + "
      f"{st.terms['exposed_sync_s']:,.3f} + {st.terms['tail_s']:,.3f} + optimizer {st.terms['optimizer_s']:,.3f} "
      f"= {t.step_time_s:,.3f} s")
    ranks = (f"{c.total_gpus // (c.tp * c.cp)} data-parallel ranks (GPUs / (tp {c.tp} x cp {c.cp}))"
             if c.tp * c.cp > 1 else f"{c.total_gpus}")
    w(f"   tokens per step = {c.micro_batch} x {s} x {ranks} x {c.grad_accum} = {c.global_batch_tokens:,}; "
      f"steps = ceil({plan.training.tokens:,} / {c.global_batch_tokens:,}) = {plan.training.steps:,}")
    overhead = float(a.raw["run"]["overhead_hours"])
    w(f"   time = {plan.training.steps:,} x {t.step_time_s:,.3f} s / 3600 + {overhead:g} h start-up = "
      f"{plan.time_hours:,.2f} h")
    ideal = 6 * n_params * plan.training.tokens / (c.total_gpus * peak * 1e12 * t.mfu_assumed) / 3600
    w(f"   | rule of thumb 6 N D / (GPUs x peak x MFU) = {ideal:,.2f} h")
    if plan.instance.price_per_hour_usd is not None:
        w(f"   cost = {plan.time_hours:,.2f} h x {c.nodes} nodes x ${plan.instance.price_per_hour_usd:,.3f}/h = "
          f"${plan.cost_usd:,.2f}")
    w(f"   tokens/s = {t.tokens_per_s:,.0f}; MFU = tokens/s x model FLOPs / (GPUs x peak) = {t.mfu:.1%}")
    w("")
    w("7. Host rules")
    for chk in plan.host.checks:
        w(f"   [{'ok' if chk.ok else 'SHORT'}] {chk.rule}: need {chk.required}; have {chk.actual}")
    w(f"   checkpoint = {plan.host.checkpoint_bytes / TB:,.2f} TB (16 B x trainable params) x {plan.host.checkpoints_kept} kept")
    if plan.notes:
        w("")
        w("Notes:")
        for n in plan.notes:
            w(f"   - {n}")
    return "\n".join(out)
