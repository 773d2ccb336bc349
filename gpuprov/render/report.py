"""The bundle's README.md (what was planned and why, how to apply it), topology.svg and (render/charts.py)
memory.svg and cost.svg.

Pure: reads the Plan, decides nothing. Numbers are formatted with fixed precision and the SVG
is built from integers, so the same plan always gives the same bytes.
"""

from __future__ import annotations

import re

from gpuprov.candidates import layout_label
from gpuprov.host import hosts_left_out
from gpuprov.render import RenderedFiles
from gpuprov.render.escape import comment, md, md_code, svg
from gpuprov.render.step_terms import step_terms_text
from gpuprov.units import GiB, TB, gib, tb




_GDS_MODES = {  # what cuFile does on the local NVMe (plan.software.gds_mode)
    "compat": "compatibility mode: POSIX reads; nvidia-fs needs DOCA's GDS-enabled NVMe driver",
    "nvidia-fs": "nvidia-fs mode: direct NVMe to GPU reads",
}

def _usd(x: float | None) -> str:
    return "n/a (owned hardware)" if x is None else f"${x:,.0f}"


def _hours(h: float | None) -> str:
    if h is None:
        return "n/a"
    return f"{h:,.1f} h ({h / 24:,.1f} days)" if h >= 48 else f"{h:,.1f} h"


def _md(text: object) -> str:
    """Table-cell safe text (a `|` that md() already escaped stays as it is)."""
    return re.sub(r"(?<!\\)\|", r"\\|", comment(text, limit=10_000))


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
        ["Model", f"{md(m.display_name)} ({md_code(m.name)}, {m.hf_model_type})"],
        ["Parameters", f"{m.params:,} total, {m.trainable_params:,} trainable"],
        ["Task", plan.task + (f" (rank {plan.training.lora_rank}, targets {', '.join(plan.training.lora_targets)})"
                              if plan.task != "full" else "")],
        ["Where", f"{where}: {c.nodes} x `{c.instance_type}` ({price})"],
        ["GPUs", f"{c.total_gpus} x {plan.gpu.name} ({c.gpus_per_node} per node, {gib(plan.gpu.memory_bytes)} each)"],
        ["Parallelism", layout_label(c.sharding, c.replica_gpus, c.total_gpus, c.tp, c.cp, c.pp)],
        ["Batch", f"micro-batch {c.micro_batch} x seq {c.seq_len} x grad-accum {c.grad_accum} "
                  f"= {c.global_batch_tokens:,} tokens per step"],
        ["Precision / optimizer", f"{c.precision}, {c.optimizer}, offload {c.offload}, "
                                  f"activation checkpointing {c.activation_checkpointing}"],
        ["Training", f"{plan.training.tokens:,} tokens in {plan.training.steps:,} steps"],
        ["Time", _hours(plan.time_hours)],
        ["Cost", _usd(plan.cost_usd)],
        ["Fabric", _fabric_words(plan)],
    ]
    return _table(["", ""], rows)


def _memory(plan) -> list[str]:
    mem = plan.memory
    usable = int(mem.gpu_memory_bytes * (1 - mem.safety_margin))
    rows = [[term, gib(b), f"{100 * b / mem.per_gpu_bytes:.1f}%" if mem.per_gpu_bytes else "-"]
            for term, b in sorted(mem.breakdown.items(), key=lambda kv: (-kv[1], kv[0])) if b > 0]
    zero = sorted(term for term, b in mem.breakdown.items() if b <= 0)
    rows.append(["**total per GPU**", f"**{gib(mem.per_gpu_bytes)}**", "100.0%"])
    out = [
        "## Memory: why it fits",
        "",
        f"Peak memory on the busiest GPU, term by term. Usable: {gib(usable)} "
        f"({gib(mem.gpu_memory_bytes)} less a {mem.safety_margin:.0%} safety margin); "
        f"headroom {gib(mem.headroom_bytes)}; fits: **{'yes' if mem.fits else 'NO'}**.",
        "",
        *_table(["term", "per GPU", "share"], rows),
        "",
        *([f"Zero in this configuration: {', '.join(zero)}.", ""] if zero else []),
        f"Model states (weights, gradients, optimizer) over all GPUs: {gib(mem.model_states_bytes)}. "
        f"The widely quoted 18 bytes/parameter rule of thumb for mixed-precision Adam says {gib(mem.rule_of_thumb_bytes)}"
        + (" (it ignores activations, buffers and fragmentation, and overstates LoRA)."
           if plan.task != "full" else " (it ignores activations, buffers and fragmentation)."),
    ]
    if mem.assumptions:
        out += ["", "Assumptions:", ""] + [f"- {a}" for a in mem.assumptions]
    return out + [""]


def _throughput(plan) -> list[str]:
    t = plan.throughput
    rows: list[list[object]] = [
        ["Cluster throughput", f"{t.tokens_per_s:,.0f} tokens/s"],
        ["Model FLOPs per token", f"{t.flops_per_token:.3e}"],
        ["MFU", f"{t.mfu:.1%} of the GPUs' BF16 peak in model FLOPs; the operations it runs reach "
                f"{t.mfu_assumed:.0%} of peak on average on the work it executes ({t.mfu_source}); recompute and "
                f"communication that compute cannot hide take the rest"],
        ["Step time", f"{t.step_time_s:.2f} s = compute {t.compute_time_s:.2f} s + exposed "
                      f"communication {t.comm_time_s:.2f} s ({t.bound}-bound)"],
        ["Wall time", _hours(plan.time_hours)],
        ["Cost", _usd(plan.cost_usd)],
    ]
    if t.step_terms_s:
        rows.insert(4, ["Step by operation", step_terms_text(t.step_terms_s)])
    return ["## Time and cost", "", *_table(["", ""], rows), ""]


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


def _login(entry) -> str:
    """' (user U, port P)' for a host that states them, else ''."""
    parts = ([f"user {md(entry.user)}"] if entry.user else []) + ([f"port {entry.port}"] if entry.port else [])
    return f" ({', '.join(parts)})" if parts else ""


def _hosts(plan) -> list[str]:
    h = plan.host
    out = [
        "## Host checklist",
        "",
        f"Each node needs at least {gib(h.ram_bytes_required)} RAM, {h.cpu_cores_required} CPU cores and "
        f"{tb(h.nvme_bytes_required)} of local NVMe (checkpoints: {gib(h.checkpoint_bytes)} each, "
        f"{h.checkpoints_kept} kept, whole cluster).",
        "",
        *_table(["check", "required", "actual", "ok", "source"],
                [[c.rule, c.required, c.actual, "yes" if c.ok else "**NO**", c.source] for c in h.checks]),
        "",
    ]
    if h.bill_of_materials:
        out += ["Bill of materials per node:", ""] + [f"- {item}" for item in h.bill_of_materials] + [""]
    if plan.hosts:
        out += ["Hosts:", ""] + [f"- {md_code(e.name)}: {md(e.address)}" + _login(e) for e in plan.hosts] + [""]
    left = hosts_left_out(plan)
    if left:
        out += [f"Left out ({len(left)} of the {len(plan.spec.hosts)} hosts listed; not in the Ansible inventory, "
                "the Notes say why):", ""] + [f"- {md_code(e.name)}: {md(e.address)}" for e in left] + [""]
    return out


def _stack(plan) -> list[str]:
    s, f, st = plan.software, plan.fabric, plan.storage
    out = [
        "## Software, fabric and storage",
        "",
        f"- OS images: {', '.join(s.os)}"
        + (f"; image profile `{s.image_profile.name}` (catalog images.yaml: what the roles keep)" if s.image_profile else ""),
        f"- NVIDIA driver {s.driver_branch} ({'open' if s.open_kernel_modules else 'proprietary'} kernel modules), "
        f"CUDA {s.cuda_version}, NCCL {s.nccl_version}"
        + (", nvidia-fabricmanager (NVSwitch)" if s.fabric_manager else "")
        + (f", EFA installer {s.efa_installer_version}" if s.efa_installer_version else "")
        + (f", GPUDirect Storage ({_GDS_MODES[s.gds_mode]})" if s.gds else ""),
        f"- Training environment: {s.python_env_path} ({', '.join(s.python_requirements) or 'no pins'})",
        f"- {_fabric_words(plan).replace('fabric ', 'Fabric: ', 1) if plan.cluster.nodes > 1 else 'Fabric: none (one node)'}"
        + (f", subnet manager {f.subnet_manager}" if f.subnet_manager != "none" else "")
        + (f", MTU {f.mtu}" if f.mtu else "") + (f", HCAs {', '.join(f.hcas)}" if f.hcas else "")
        + (f"; not configured: {f.probe}" if f.probe else ""),
        (f"- Storage: RAID0 of {st.devices} local NVMe drives ({tb(st.expected_bytes)}) as "
         f"/dev/md/{st.raid_name}, {st.filesystem} on {st.mount_point}") if st.devices else
        "- Storage: no local NVMe array (none known to the plan)",
    ] + _bringup(plan)
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


def _bringup(plan) -> list[str]:
    """Purchase option, image, access and shared storage (plan fields; on-prem: the shared export)."""
    out = []
    if plan.cluster.cloud != "onprem":
        price = plan.purchase.price_per_hour_usd
        out.append(f"- Purchase: {plan.purchase.option}" + (f", {_usd(price)}/h per node" if price is not None else "")
                   + (f" (preemptible: {_md(plan.purchase.risk)})" if plan.purchase.preemptible else ""))
    if plan.image is not None:
        out.append(f"- Image: {_md(plan.image.name)} (login user {_md(plan.image.user or 'your OS Login name')})")
    if plan.access is not None and plan.cluster.cloud != "onprem":
        out.append(f"- Access: {plan.access.method} (Ansible connects from outside the network; see ansible/inventory.yml)")
    shared = plan.shared_storage
    if shared is not None:
        size = f"{shared.size_gib:,} GiB" if shared.size_gib else "elastic"
        out.append(f"- Checkpoints: {shared.checkpoint_dir} on {shared.kind} ({size}, for {tb(shared.need_bytes)} "
                   f"of checkpoints and data)")
    return out


def _start_line(plan) -> str:
    """How training starts, as plan.scheduler decided (gpuprov/scheduler.py)."""
    s = plan.scheduler
    if s.kind == "slurm":
        return (f"The last step of `gpuprov up` submits `launch/slurm.sbatch` to Slurm (partition {md(s.partition or '')}; "
                f"a failed node requeues the job, which resumes from the newest checkpoint). Controller: {md(s.reason)}.")
    if s.kind == "existing":
        return "The last step of `gpuprov up` submits `launch/slurm.sbatch` to the site's Slurm (default partition)."
    if plan.cluster.nodes == 1:
        return "The last step of `gpuprov up` starts `launch/train.sh` on the node, in the background."
    return "Then start `launch/train.sh` on every node (no scheduler: spec `slurm: none`)."


def _apply(plan) -> list[str]:
    onprem = plan.cluster.cloud == "onprem"
    out = ["## How to apply", "", "```sh",
           "gpuprov validate .        # terraform fmt/config, ansible syntax, bash -n, plan sanity",
           "gpuprov up . --dry-run   # every command, in order",
           "gpuprov up .             # run them, ending with the job started; re-run resumes",
           "gpuprov status .         # job state, step, loss, tokens/s, MFU beside the plan",
           "gpuprov down .           # " + ("stop the job and the bundle's Slurm; the hosts stay" if onprem else
                                             "terraform destroy when done") + " (--dry-run prints it)", "```",
           "", "By hand:", "", "```sh"]
    if not onprem:
        out += ["(cd terraform && terraform init && terraform plan -out=tfplan && terraform apply tfplan)",
                "terraform -chdir=terraform output -json ansible_inventory > ansible/inventory.yml"]
    out += ["(cd ansible && ansible-playbook -i inventory.yml site.yml)",
            "(cd ansible && ansible-playbook -i inventory.yml site.yml --tags health)", "```", "",
            _start_line(plan),
            "", "Keep the bundle in git; in CI, `gpuprov check .` exits 1 when regenerating it from `gpuprov.lock` "
            "would change any file.", ""]
    return out


def render_readme(plan) -> str:
    c = plan.cluster
    lines = [
        f"# {md(plan.model.display_name)}: {plan.task} training on {c.total_gpus} x {plan.gpu.name}",
        "",
        f"Generated by gpuprov {plan.gpuprov_version} from `gpuprov.lock` (the full spec). "
        "Regenerate rather than edit: `gpuprov check .` reports hand edits as drift.",
        "",
        "![cluster topology](topology.svg)",
        "",
        "![memory per GPU by term](memory.svg)",
        "",
        "![candidates: cost against hours](cost.svg)",
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
        # notes hold validated spec values (regions, host names); one line each keeps them in the list
        lines += ["## Notes", ""] + [f"- {comment(n, limit=10_000)}" for n in plan.notes] + [""]
    lines += [*_hosts(plan), *_stack(plan), *_apply(plan)]
    lines += ["## Files", "", "- `plan.json`: the plan, machine-readable", "- `gpuprov.lock`: spec, versions, file hashes",
              "- `terraform/`: the cluster (empty on-prem)" if c.cloud == "onprem" else "- `terraform/`: the cluster",
              "- `ansible/`: node setup (driver, fabric, NCCL, storage, health check)",
              "- `launch/`: environment and training launch scripts", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- topology.svg

_MAX_NODES_DRAWN = 4  # one row


def _text(x: int, y: int, text: str, size: int = 12, anchor: str = "start", weight: str = "normal") -> str:
    return (f'<text x="{x}" y="{y}" font-size="{size}" text-anchor="{anchor}" font-weight="{weight}">'
            f"{svg(text)}</text>")


def _rect(x: int, y: int, w: int, h: int, fill: str, stroke: str = "#333", rx: int = 4) -> str:
    return f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="{rx}" fill="{fill}" stroke="{stroke}"/>'


def _line(x1: int, y1: int, x2: int, y2: int, stroke: str, width: int = 1, dash: bool = False) -> str:
    extra = ' stroke-dasharray="4 3"' if dash else ""
    return f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{stroke}" stroke-width="{width}"{extra}/>'


def _nic_layout(gpus: int, nics: int) -> list[tuple[int, float, float, int]]:
    """(rail GPU index, left, width, NICs in the box) in GPU-slot units: one box per GPU holding its k
    NICs (one line to its rail, however many NICs: 32 EFA interfaces draw 8 lines), or one box per
    group of GPUs that share a NIC."""
    if nics >= gpus:
        return [(g, float(g), 1.0, nics // gpus) for g in range(gpus)]
    span = gpus / nics
    return [(int(i * span), i * span, span, 1) for i in range(nics)]


_SWATCH = {"gpu": ("#76b900", "#3d6000", "GPU"), "nvlink": ("#9fc5e8", "#1c4587", "NVLink / NVSwitch"),
           "nic": ("#f5a623", "#8a5a00", "NIC box (its count when more than one)"),
           "raid": ("#e6e6e6", "#666", "local NVMe RAID0"), "rail": ("#fde9c8", "#8a5a00", "fabric rail / switch")}
_OUTLINE = {"tp": ("#c0392b", "tensor-parallel group"), "hsdp": ("#7b3fa0", "HSDP shard group")}


def _fabric_words(plan) -> str:
    if plan.cluster.nodes == 1:
        return "one node: no inter-node fabric"
    return f"fabric {plan.fabric.name}, {plan.fabric.gbps_per_gpu:g} Gb/s per GPU"


def _drawn_kinds(plan, multi: bool) -> list[str]:
    """What the picture shows, in legend order: the legend names only these."""
    c, inst = plan.cluster, plan.instance
    kinds = ["gpu"]
    if plan.gpu.nvlink_gbytes_per_s:
        kinds.append("nvlink")
    if plan.storage.devices:
        kinds.append("raid")
    if multi and "fabric" not in inst.unknown:
        kinds += ["nic", "rail"]
    elif multi:
        kinds.append("rail")
    if c.tp > 1:
        kinds.append("tp")
    per = max(1, c.shard_group // c.gpus_per_node)
    if c.sharding == "hsdp" and per < c.nodes:
        kinds.append("hsdp")
    return kinds


def _legend(y: int, kinds: list[str]) -> list[str]:
    """One row of swatches under the picture: what each colour and outline drawn is."""
    parts, x = [_text(20, y, "Legend:", 11, weight="bold")], 80
    for kind in kinds:
        if kind in _SWATCH:
            fill, stroke, label = _SWATCH[kind]
            parts += [_rect(x, y - 10, 14, 12, fill, stroke, 2), _text(x + 20, y, label, 11)]
        else:
            stroke, label = _OUTLINE[kind]
            parts += [f'<rect x="{x}" y="{y - 10}" width="14" height="12" rx="2" fill="none" stroke="{stroke}" '
                      f'stroke-dasharray="4 3"/>', _text(x + 20, y, label, 11)]
        x += 30 + 6 * len(label)
    return parts


def _summary_line(plan) -> str:
    m = plan.memory
    cost = "" if plan.cost_usd is None else f" | ${plan.cost_usd:,.0f}"
    return (f"memory per GPU: {m.per_gpu_bytes / GiB:,.1f} GiB peak of {m.gpu_memory_bytes / GiB:,.1f} GiB "
            f"({m.headroom_bytes / GiB:,.1f} GiB headroom) | {plan.time_hours:,.1f} h{cost}")


def _node(plan, x: int, y: int, node_w: int, node_h: int, name: str, multi: bool, rail_x: list[int],
          fabric_y: int) -> list[str]:
    c, inst, st = plan.cluster, plan.instance, plan.storage
    gpus, gpu_w, gpu_gap = c.gpus_per_node, 34, 6
    unknown = set(inst.unknown)  # on-prem facts nobody stated: drawn as unknown, never invented
    cpu = "CPU unknown" if "cores" in unknown else f"{inst.vcpus} vCPU"
    ram = "RAM unknown" if "ram" in unknown else f"{inst.ram_bytes / GiB:,.0f} GiB RAM"
    parts = [_rect(x, y, node_w, node_h, "#f4f6fb"), _text(x + 8, y + 18, f"{name}: {cpu}, {ram}", 11, weight="bold")]
    gx0 = x + (node_w - gpus * (gpu_w + gpu_gap) + gpu_gap) // 2
    gx_end = gx0 + gpus * (gpu_w + gpu_gap) - gpu_gap
    for g in range(gpus):
        gx = gx0 + g * (gpu_w + gpu_gap)
        parts += [_rect(gx, y + 30, gpu_w, 40, "#76b900", "#3d6000", 3), _text(gx + gpu_w // 2, y + 54, f"G{g}", 10, "middle")]
    if plan.gpu.nvlink_gbytes_per_s:
        label = (f"NVSwitch: NVLink {plan.gpu.nvlink_gbytes_per_s:g} GB/s per GPU" if inst.nvswitch
                 else f"NVLink {plan.gpu.nvlink_gbytes_per_s:g} GB/s per GPU")
        parts.append(_rect(gx0, y + 80, gx_end - gx0, 16, "#9fc5e8", "#1c4587", 3))
        parts += [_line(gx0 + g * (gpu_w + gpu_gap) + gpu_w // 2, y + 70, gx0 + g * (gpu_w + gpu_gap) + gpu_w // 2,
                        y + 80, "#1c4587", 2) for g in range(gpus)]
        parts.append(_text((gx0 + gx_end) // 2, y + 92, label, 10, "middle"))
    else:
        parts.append(_text((gx0 + gx_end) // 2, y + 92, f"PCIe gen {plan.gpu.pcie_gen} (no NVLink)", 10, "middle"))
    if st.devices:
        parts.append(_rect(gx0, y + 104, gx_end - gx0, 30, "#e6e6e6", "#666", 3))
        parts.append(_text((gx0 + gx_end) // 2, y + 117, f"RAID0 {st.devices} x NVMe = {st.expected_bytes / TB:,.1f} TB",
                           10, "middle"))
        parts.append(_text((gx0 + gx_end) // 2, y + 129, f"{st.filesystem} on {st.mount_point}", 10, "middle"))
    elif "nvme" in unknown:
        parts.append(_text((gx0 + gx_end) // 2, y + 117, "NVMe unknown: run gpuprov hosts probe", 10, "middle"))
    if multi and "fabric" in unknown:
        parts.append(_text((gx0 + gx_end) // 2, y + node_h - 6, "NICs unknown: run gpuprov hosts probe", 10, "middle"))
    elif multi:
        slot = gpu_w + gpu_gap
        nic_y = y + node_h - 14
        for rail_gpu, left, span, count in _nic_layout(gpus, inst.network_cards or gpus):
            nx, nw = gx0 + int(left * slot) + 1, max(2, int(span * slot) - gpu_gap - 2)
            parts.append(_rect(nx, nic_y, nw, 10, "#f5a623", "#8a5a00", 2))
            if count > 1:
                parts.append(_text(nx + nw // 2, nic_y + 8, f"{count}x", 7, "middle"))
            parts.append(_line(nx + nw // 2, nic_y + 10, rail_x[rail_gpu % len(rail_x)], fabric_y, "#c77800"))
    parts += _tp_groups(plan, gx0, y, gpu_w, gpu_gap)
    return parts


def _tp_groups(plan, gx0: int, y: int, gpu_w: int, gpu_gap: int) -> list[str]:
    """A dashed outline around each tensor-parallel group of GPUs inside the node."""
    tp = plan.cluster.tp
    if tp <= 1:
        return []
    slot, parts = gpu_w + gpu_gap, []
    for first in range(0, plan.cluster.gpus_per_node, tp):
        x0 = gx0 + first * slot - 3
        parts.append(f'<rect x="{x0}" y="{y + 26}" width="{tp * slot - gpu_gap + 6}" height="48" rx="4" '
                     f'fill="none" stroke="#c0392b" stroke-width="1.5" stroke-dasharray="4 3"/>')
    return parts


def _hsdp_groups(plan, drawn: int, node_w: int, node_h: int, gap: int) -> list[str]:
    c = plan.cluster
    per = max(1, c.shard_group // c.gpus_per_node)
    if c.sharding != "hsdp" or per >= c.nodes:
        return []
    parts = []
    for first in range(0, drawn, per):
        last = min(first + per, drawn) - 1
        x0, x1 = 20 + first * (node_w + gap) - 6, 20 + last * (node_w + gap) + node_w + 6
        parts.append(f'<rect x="{x0}" y="62" width="{x1 - x0}" height="{node_h + 16}" rx="6" fill="none" '
                     f'stroke="#7b3fa0" stroke-width="2" stroke-dasharray="4 3"/>')
        parts.append(_text(x0 + 4, 60, f"shard group {first // per}", 10))
    return parts


def render_topology(plan) -> str:
    c, inst, fab = plan.cluster, plan.instance, plan.fabric
    gpus = c.gpus_per_node
    # one row of nodes: the rail lines run straight down to the switches, crossing no other node
    drawn = min(c.nodes, _MAX_NODES_DRAWN)
    node_w, node_h, gap = max(220, gpus * 40 + 30), 170, 24
    extra_box = c.nodes > drawn
    width = max(40 + drawn * (node_w + gap) + (node_w // 2 + gap if extra_box else 0), 760)
    multi = c.nodes > 1 and fab.name != "none"
    nics = inst.network_cards or gpus
    rails = min(gpus, nics) if fab.name not in ("ethernet", "none") else 1
    fabric_y = 80 + node_h + 60
    legend_y = fabric_y + (90 if multi else 30) + 10
    height = legend_y + 30
    names = [h.name for h in plan.hosts] if plan.hosts else [f"node {i}" for i in range(c.nodes)]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
        _rect(0, 0, width, height, "#ffffff", "none", 0),
        _text(20, 22, f"{plan.model.display_name} ({plan.task}): {c.nodes} x {c.instance_type}, "
                      f"{c.total_gpus} x {plan.gpu.name}", 15, weight="bold"),
        _text(20, 38, f"{c.cloud}{' ' + c.region if c.region else ''} | "
                      f"{layout_label(c.sharding, c.replica_gpus, c.total_gpus, c.tp, c.cp, c.pp)} | "
                      f"{_fabric_words(plan)}", 12),
        _text(20, 52, _summary_line(plan), 12),
    ]
    rail_w = min(max(60, (width - 40 - (rails - 1) * 8) // rails), 140)
    start = (width - (rails * rail_w + (rails - 1) * 8)) // 2
    rail_x = [start + r * (rail_w + 8) + rail_w // 2 for r in range(rails)] if multi else []
    for index in range(drawn):
        name = names[index] if index < len(names) else f"node {index}"
        parts += _node(plan, 20 + index * (node_w + gap), 70, node_w, node_h, name, multi, rail_x, fabric_y)
    parts += _hsdp_groups(plan, drawn, node_w, node_h, gap)
    if extra_box:
        x = 20 + drawn * (node_w + gap)
        parts.append(_rect(x, 70, node_w // 2, node_h, "#fafafa", "#999"))
        parts.append(_text(x + node_w // 4, 70 + node_h // 2, f"+ {c.nodes - drawn} more nodes", 12, "middle"))
    if multi:
        label = "rail" if rails > 1 else fab.name
        for r, cx in enumerate(rail_x):
            parts.append(_rect(cx - rail_w // 2, fabric_y, rail_w, 28, "#fde9c8", "#8a5a00"))
            parts.append(_text(cx, fabric_y + 18, f"{label} {r}" if rails > 1 else fab.name, 10, "middle"))
        parts.append(_text(width // 2, fabric_y + 50,
                           f"{fab.name}: {rails} rail{'s' if rails > 1 else ''}, {fab.gbps_per_gpu:g} Gb/s per GPU, "
                           f"{fab.gbps_per_gpu * gpus:,.0f} Gb/s per node over {nics} NIC{'s' if nics > 1 else ''}",
                           12, "middle"))
    else:
        parts.append(_text(20, fabric_y, "single node: no inter-node fabric needed" if c.nodes == 1
                           else "no RDMA fabric", 12))
    parts += _legend(legend_y, _drawn_kinds(plan, multi))
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def render_report(plan) -> RenderedFiles:
    from gpuprov.render.charts import render_pictures

    return {"README.md": render_readme(plan), **render_pictures(plan)}
