"""The bundle's README.md (what was planned and why, how to apply it) and topology.svg.

Pure: reads the Plan, decides nothing. Numbers are formatted with fixed precision and the SVG
is built from integers, so the same plan always gives the same bytes.
"""

from __future__ import annotations

from gpuprov.host import hosts_left_out
from gpuprov.render import RenderedFiles

GiB = 2**30
TB = 10**12



_GDS_MODES = {  # what cuFile does on the local NVMe (plan.software.gds_mode)
    "compat": "compatibility mode: POSIX reads; nvidia-fs needs DOCA's GDS-enabled NVMe driver",
    "nvidia-fs": "nvidia-fs mode: direct NVMe to GPU reads",
}

def _gib(n: int | float) -> str:
    return f"{n / GiB:,.1f} GiB"


def _tb(n: int | float) -> str:
    return f"{n / TB:,.2f} TB"


def _usd(x: float | None) -> str:
    return "n/a (owned hardware)" if x is None else f"${x:,.0f}"


def _hours(h: float | None) -> str:
    if h is None:
        return "n/a"
    return f"{h:,.1f} h ({h / 24:,.1f} days)" if h >= 48 else f"{h:,.1f} h"


def _md(text: object) -> str:
    """Table-cell safe text."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
    return out


def _summary(plan) -> list[str]:
    c, m, i = plan.cluster, plan.model, plan.instance
    where = f"{c.cloud}" + (f" {c.region}" if c.region else "")
    price = (f"${i.price_per_hour_usd:,.2f}/h per node (price of {i.price_date})"
             if i.price_per_hour_usd is not None else "owned hardware")
    rows = [
        ["Model", f"{m.display_name} (`{m.name}`, {m.hf_model_type})"],
        ["Parameters", f"{m.params:,} total, {m.trainable_params:,} trainable"],
        ["Task", plan.task + (f" (rank {plan.training.lora_rank}, targets {', '.join(plan.training.lora_targets)})"
                              if plan.task != "full" else "")],
        ["Where", f"{where}: {c.nodes} x `{c.instance_type}` ({price})"],
        ["GPUs", f"{c.total_gpus} x {plan.gpu.name} ({c.gpus_per_node} per node, {_gib(plan.gpu.memory_bytes)} each)"],
        ["Parallelism", f"{c.sharding}: shard group {c.shard_group} GPUs x {c.replicate} "
                        f"replica{'s' if c.replicate != 1 else ''}"],
        ["Batch", f"micro-batch {c.micro_batch} x seq {c.seq_len} x grad-accum {c.grad_accum} "
                  f"= {c.global_batch_tokens:,} tokens per step"],
        ["Precision / optimizer", f"{c.precision}, {c.optimizer}, offload {c.offload}, "
                                  f"activation checkpointing {c.activation_checkpointing}"],
        ["Training", f"{plan.training.tokens:,} tokens in {plan.training.steps:,} steps"],
        ["Time", _hours(plan.time_hours)],
        ["Cost", _usd(plan.cost_usd)],
        ["Fabric", f"{plan.fabric.name}, {plan.fabric.gbps_per_gpu:g} Gb/s per GPU"],
    ]
    return _table(["", ""], rows)


def _memory(plan) -> list[str]:
    mem = plan.memory
    usable = int(mem.gpu_memory_bytes * (1 - mem.safety_margin))
    rows = [[term, _gib(b), f"{100 * b / mem.per_gpu_bytes:.1f}%" if mem.per_gpu_bytes else "-"]
            for term, b in sorted(mem.breakdown.items(), key=lambda kv: (-kv[1], kv[0])) if b > 0]
    zero = sorted(term for term, b in mem.breakdown.items() if b <= 0)
    rows.append(["**total per GPU**", f"**{_gib(mem.per_gpu_bytes)}**", "100.0%"])
    out = [
        "## Memory: why it fits",
        "",
        f"Peak memory on the busiest GPU, term by term. Usable: {_gib(usable)} "
        f"({_gib(mem.gpu_memory_bytes)} less a {mem.safety_margin:.0%} safety margin); "
        f"headroom {_gib(mem.headroom_bytes)}; fits: **{'yes' if mem.fits else 'NO'}**.",
        "",
        *_table(["term", "per GPU", "share"], rows),
        "",
        *([f"Zero in this configuration: {', '.join(zero)}.", ""] if zero else []),
        f"Model states (weights, gradients, optimizer) over all GPUs: {_gib(mem.model_states_bytes)}. "
        f"The 18 bytes/parameter rule of thumb says {_gib(mem.rule_of_thumb_bytes)}"
        + (" (it ignores activations, buffers and fragmentation, and overstates LoRA)."
           if plan.task != "full" else " (it ignores activations, buffers and fragmentation)."),
    ]
    if mem.assumptions:
        out += ["", "Assumptions:", ""] + [f"- {a}" for a in mem.assumptions]
    return out + [""]


def _throughput(plan) -> list[str]:
    t = plan.throughput
    return [
        "## Time and cost",
        "",
        *_table(["", ""], [
            ["Cluster throughput", f"{t.tokens_per_s:,.0f} tokens/s"],
            ["Model FLOPs per token", f"{t.flops_per_token:.3e}"],
            ["MFU", f"{t.mfu:.1%} (starting from an assumed {t.mfu_assumed:.1%}: {t.mfu_source})"],
            ["Step time", f"{t.step_time_s:.2f} s = compute {t.compute_time_s:.2f} s + exposed "
                          f"communication {t.comm_time_s:.2f} s ({t.bound}-bound)"],
            ["Wall time", _hours(plan.time_hours)],
            ["Cost", _usd(plan.cost_usd)],
        ]),
        "",
    ]


def _alternatives(plan) -> list[str]:
    if not plan.alternatives:
        return ["## Configurations considered", "", "No other configuration was within the constraints.", ""]
    rows = [[a.cloud, a.instance_type, a.gpu, a.nodes, a.total_gpus, a.sharding,
             "-" if a.time_hours is None else f"{a.time_hours:,.1f} h",
             "-" if a.cost_usd is None else f"${a.cost_usd:,.0f}", a.reason] for a in plan.alternatives]
    c = plan.cluster
    chosen = [f"**{c.cloud}**", f"**{c.instance_type}**", f"**{c.gpu}**", c.nodes, c.total_gpus, c.sharding,
              f"{plan.time_hours:,.1f} h", "-" if plan.cost_usd is None else f"${plan.cost_usd:,.0f}",
              f"chosen (objective: {plan.spec.objective})"]
    return ["## Configurations considered", "",
            *_table(["cloud", "instance", "GPU", "nodes", "GPUs", "sharding", "time", "cost", "verdict"],
                    [chosen] + rows), ""]


def _hosts(plan) -> list[str]:
    h = plan.host
    out = [
        "## Host checklist",
        "",
        f"Each node needs at least {_gib(h.ram_bytes_required)} RAM, {h.cpu_cores_required} CPU cores and "
        f"{_tb(h.nvme_bytes_required)} of local NVMe (checkpoints: {_gib(h.checkpoint_bytes)} each, "
        f"{h.checkpoints_kept} kept, whole cluster).",
        "",
        *_table(["check", "required", "actual", "ok", "source"],
                [[c.rule, c.required, c.actual, "yes" if c.ok else "**NO**", c.source] for c in h.checks]),
        "",
    ]
    if h.bill_of_materials:
        out += ["Bill of materials per node:", ""] + [f"- {item}" for item in h.bill_of_materials] + [""]
    if plan.hosts:
        out += ["Hosts:", ""] + [f"- `{e.name}`: {e.address}" + (f" (user {e.user})" if e.user else "")
                                 for e in plan.hosts] + [""]
    left = hosts_left_out(plan)
    if left:
        out += [f"Left out ({len(left)} of the {len(plan.spec.hosts)} hosts listed; not in the Ansible inventory, "
                "the Notes say why):", ""] + [f"- `{e.name}`: {e.address}" for e in left] + [""]
    return out


def _stack(plan) -> list[str]:
    s, f, st = plan.software, plan.fabric, plan.storage
    out = [
        "## Software, fabric and storage",
        "",
        f"- OS images: {', '.join(s.os)}",
        f"- NVIDIA driver {s.driver_branch} ({'open' if s.open_kernel_modules else 'proprietary'} kernel modules), "
        f"CUDA {s.cuda_version}, NCCL {s.nccl_version}"
        + (", nvidia-fabricmanager (NVSwitch)" if s.fabric_manager else "")
        + (f", EFA installer {s.efa_installer_version}" if s.efa_installer_version else "")
        + (f", GPUDirect Storage ({_GDS_MODES[s.gds_mode]})" if s.gds else ""),
        f"- Training environment: {s.python_env_path} ({', '.join(s.python_requirements) or 'no pins'})",
        f"- Fabric: {f.name}, {f.gbps_per_gpu:g} Gb/s per GPU"
        + (f", subnet manager {f.subnet_manager}" if f.subnet_manager != "none" else "")
        + (f", MTU {f.mtu}" if f.mtu else "") + (f", HCAs {', '.join(f.hcas)}" if f.hcas else ""),
        f"- Storage: RAID0 of {st.devices} local NVMe drives ({_tb(st.expected_bytes)}) as "
        f"/dev/md/{st.raid_name}, {st.filesystem} on {st.mount_point}",
    ]
    if f.nccl_env or f.nccl_env_profile:
        out += ["", "NCCL environment (the Ansible nccl role and launch/env.sh both come from this):", "", "```sh"]
        exports = [f"export {k}={v}" for k, v in sorted(f.nccl_env.items())]
        if f.nccl_env_profile:
            # Exported before the vendor profile (it may read them, e.g. NCCL_LIB_DIR) and again
            # after it, so the plan's values win: the order launch/env.sh uses.
            out += exports + [f"source {f.nccl_env_profile}"]
        out += exports + ["```"]
    if plan.health.nccl_allreduce_busbw_gbytes_per_s:
        out += ["", f"Health check: NCCL all-reduce bus bandwidth on one node must reach "
                    f"{plan.health.nccl_allreduce_busbw_gbytes_per_s:g} GB/s ({plan.health.source})."]
    return out + [""]


def _apply(plan) -> list[str]:
    onprem = plan.cluster.cloud == "onprem"
    out = ["## How to apply", "", "```sh", "gpuprov validate .        # terraform fmt/config, ansible syntax, bash -n, plan sanity",
           "gpuprov up . --dry-run   # every command, in order", "gpuprov up .             # run them; re-run resumes", "```",
           "", "By hand:", "", "```sh"]
    if not onprem:
        out += ["(cd terraform && terraform init && terraform plan -out=tfplan && terraform apply tfplan)",
                "terraform -chdir=terraform output -json ansible_inventory > ansible/inventory.yml"]
    out += ["(cd ansible && ansible-playbook -i inventory.yml site.yml)",
            "(cd ansible && ansible-playbook -i inventory.yml site.yml --tags health)", "```", "",
            "Then start training with the scripts in `launch/` (the last step of `gpuprov up` prints the command).",
            "", "Keep the bundle in git; in CI, `gpuprov check .` exits 1 when regenerating it from `gpuprov.lock` "
            "would change any file.", ""]
    return out


def render_readme(plan) -> str:
    c = plan.cluster
    lines = [
        f"# {plan.model.display_name}: {plan.task} training on {c.total_gpus} x {plan.gpu.name}",
        "",
        f"Generated by gpuprov {plan.gpuprov_version} from `gpuprov.lock` (the full spec). "
        "Regenerate rather than edit: `gpuprov check .` reports hand edits as drift.",
        "",
        "![cluster topology](topology.svg)",
        "",
        "## The plan",
        "",
        *_summary(plan),
        "",
        *_memory(plan),
        *_throughput(plan),
        *_alternatives(plan),
    ]
    if plan.notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in plan.notes] + [""]
    lines += [*_hosts(plan), *_stack(plan), *_apply(plan)]
    lines += ["## Files", "", "- `plan.json`: the plan, machine-readable", "- `gpuprov.lock`: spec, versions, file hashes",
              "- `terraform/`: the cluster (empty on-prem)" if c.cloud == "onprem" else "- `terraform/`: the cluster",
              "- `ansible/`: node setup (driver, fabric, NCCL, storage, health check)",
              "- `launch/`: environment and training launch scripts", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- topology.svg

_MAX_NODES_DRAWN = 8


def escape(text: str) -> str:
    """XML character data: what xml.sax.saxutils.escape does, without importing urllib with it."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _text(x: int, y: int, text: str, size: int = 12, anchor: str = "start", weight: str = "normal") -> str:
    return (f'<text x="{x}" y="{y}" font-size="{size}" text-anchor="{anchor}" font-weight="{weight}">'
            f"{escape(text)}</text>")


def _rect(x: int, y: int, w: int, h: int, fill: str, stroke: str = "#333", rx: int = 4) -> str:
    return f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="{rx}" fill="{fill}" stroke="{stroke}"/>'


def _line(x1: int, y1: int, x2: int, y2: int, stroke: str, width: int = 1, dash: bool = False) -> str:
    extra = ' stroke-dasharray="4 3"' if dash else ""
    return f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{stroke}" stroke-width="{width}"{extra}/>'


def render_topology(plan) -> str:
    c, inst, fab, st = plan.cluster, plan.instance, plan.fabric, plan.storage
    gpus = c.gpus_per_node
    drawn = min(c.nodes, _MAX_NODES_DRAWN)
    gpu_w, gpu_gap = 34, 6
    node_w = max(220, gpus * (gpu_w + gpu_gap) + 30)
    node_h = 170
    gap = 24
    columns = min(drawn, 4)
    rows = -(-drawn // columns)
    extra_box = c.nodes > drawn
    # wide enough for the title line too (about 8 px per character at 15 px)
    width = max(40 + columns * (node_w + gap) + (node_w // 2 + gap if extra_box else 0), 760)
    multi = c.nodes > 1 and fab.name != "none"
    rails = gpus if fab.name not in ("ethernet", "none") else 1
    fabric_y = 70 + rows * (node_h + gap) + 40
    height = fabric_y + (90 if multi else 20) + 40
    names = [h.name for h in plan.hosts] if plan.hosts else [f"node {i}" for i in range(c.nodes)]

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
        _rect(0, 0, width, height, "#ffffff", "none", 0),
        _text(20, 28, f"{plan.model.display_name} ({plan.task}): {c.nodes} x {c.instance_type}, "
                      f"{c.total_gpus} x {plan.gpu.name}", 15, weight="bold"),
        _text(20, 48, f"{c.cloud}{' ' + c.region if c.region else ''} | {c.sharding} shard group {c.shard_group} "
                      f"x {c.replicate} | fabric {fab.name} {fab.gbps_per_gpu:g} Gb/s per GPU", 12),
    ]
    rail_x: list[int] = []
    if multi:
        rail_w = max(60, (width - 40 - (rails - 1) * 8) // rails)
        rail_w = min(rail_w, 140)
        total = rails * rail_w + (rails - 1) * 8
        start = (width - total) // 2
        rail_x = [start + r * (rail_w + 8) + rail_w // 2 for r in range(rails)]
    for index in range(drawn):
        col, row = index % columns, index // columns
        x, y = 20 + col * (node_w + gap), 70 + row * (node_h + gap)
        parts.append(_rect(x, y, node_w, node_h, "#f4f6fb"))
        parts.append(_text(x + 8, y + 18, f"{names[index] if index < len(names) else f'node {index}'}: "
                                          f"{inst.vcpus} vCPU, {inst.ram_bytes / GiB:,.0f} GiB RAM", 11, weight="bold"))
        gx0 = x + (node_w - gpus * (gpu_w + gpu_gap) + gpu_gap) // 2
        for g in range(gpus):
            gx = gx0 + g * (gpu_w + gpu_gap)
            parts.append(_rect(gx, y + 30, gpu_w, 40, "#76b900", "#3d6000", 3))
            parts.append(_text(gx + gpu_w // 2, y + 54, f"G{g}", 10, "middle"))
            if multi:
                nic_y = y + node_h - 14
                parts.append(_rect(gx + 7, nic_y, gpu_w - 14, 10, "#f5a623", "#8a5a00", 2))
                rail = g % rails
                parts.append(_line(gx + gpu_w // 2, nic_y + 10, rail_x[rail], fabric_y, "#c77800"))
        gx_end = gx0 + gpus * (gpu_w + gpu_gap) - gpu_gap
        if plan.gpu.nvlink_gbytes_per_s:
            label = (f"NVSwitch: NVLink {plan.gpu.nvlink_gbytes_per_s:g} GB/s per GPU" if inst.nvswitch
                     else f"NVLink {plan.gpu.nvlink_gbytes_per_s:g} GB/s per GPU")
            parts.append(_rect(gx0, y + 80, gx_end - gx0, 16, "#9fc5e8", "#1c4587", 3))
            for g in range(gpus):
                gx = gx0 + g * (gpu_w + gpu_gap) + gpu_w // 2
                parts.append(_line(gx, y + 70, gx, y + 80, "#1c4587", 2))
            parts.append(_text((gx0 + gx_end) // 2, y + 92, label, 10, "middle"))
        else:
            parts.append(_text((gx0 + gx_end) // 2, y + 92, f"PCIe gen {plan.gpu.pcie_gen} (no NVLink)", 10, "middle"))
        if st.devices:
            parts.append(_rect(gx0, y + 104, gx_end - gx0, 30, "#e6e6e6", "#666", 3))
            parts.append(_text((gx0 + gx_end) // 2, y + 117,
                               f"RAID0 {st.devices} x NVMe = {st.expected_bytes / TB:,.1f} TB", 10, "middle"))
            parts.append(_text((gx0 + gx_end) // 2, y + 129, f"{st.filesystem} on {st.mount_point}", 10, "middle"))
    if extra_box:
        x = 20 + columns * (node_w + gap)
        parts.append(_rect(x, 70, node_w // 2, node_h, "#fafafa", "#999"))
        parts.append(_text(x + node_w // 4, 70 + node_h // 2, f"+ {c.nodes - drawn} more nodes", 12, "middle"))
    if multi:
        label = "rail" if rails > 1 else fab.name
        rail_w = min(max(60, (width - 40 - (rails - 1) * 8) // rails), 140)
        for r, cx in enumerate(rail_x):
            parts.append(_rect(cx - rail_w // 2, fabric_y, rail_w, 28, "#fde9c8", "#8a5a00"))
            parts.append(_text(cx, fabric_y + 18, f"{label} {r}" if rails > 1 else fab.name, 10, "middle"))
        parts.append(_text(width // 2, fabric_y + 50,
                           f"{fab.name}: {rails} rail{'s' if rails > 1 else ''}, {fab.gbps_per_gpu:g} Gb/s per GPU, "
                           f"{fab.gbps_per_gpu * gpus:,.0f} Gb/s per node"
                           + (f" over {inst.network_cards} NICs" if inst.network_cards else ""), 12, "middle"))
    else:
        parts.append(_text(20, fabric_y, "single node: no inter-node fabric needed" if c.nodes == 1
                           else "no RDMA fabric", 12))
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def render_report(plan) -> RenderedFiles:
    return {"README.md": render_readme(plan), "topology.svg": render_topology(plan)}
