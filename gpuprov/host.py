"""Host sizing: the common rules of thumb (host_rules.yaml, each sourced) applied to one node of a plan.

Cloud instances are checked (where does this machine fall short of a rule); on-prem templates
are sized from the same rules and come back with a bill of materials.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from gpuprov.catalog import load_data
from gpuprov.catalog.instances import InstanceType
from gpuprov.plan import Host, HostCheck
from gpuprov.units import GiB, gib, tb

RDMA_FABRICS = ("efa", "infiniband", "roce", "tcpxo")


@lru_cache(maxsize=1)
def rules() -> dict[str, Any]:
    return load_data("host_rules.yaml")


@dataclass(frozen=True)
class HostNeeds:
    """What one node of this job needs from its host, from the rules (bytes, cores)."""

    gpu_memory_bytes: int  # all GPUs of the node
    ram_min_bytes: int
    ram_recommended_bytes: int
    cores_min: int
    cores_recommended: int
    checkpoint_bytes: int  # one full-state checkpoint of the whole model (all nodes)
    checkpoints_kept: int
    nvme_bytes: int  # per node: its checkpoint share x kept + dataset share + base weights, + headroom
    multinode: bool


def host_needs(
    *,
    gpu_memory_bytes: int,
    gpus_per_node: int,
    nodes: int,
    params: int,
    trainable: int,
    tokens: int,
    task: str,
    offload: str = "none",
) -> HostNeeds:
    r = rules()
    node_gpu_mem = gpu_memory_bytes * gpus_per_node
    offload_bytes = 0
    if offload != "none":
        # offloaded optimizer states live in this node's RAM: its share of the trainable params
        offload_bytes = math.ceil(trainable * r["ram"]["offload_extra_bytes_per_param"] / nodes)
    ram_min = math.ceil(node_gpu_mem * r["ram"]["min_ratio_to_gpu_memory"]) + offload_bytes
    ram_rec = math.ceil(node_gpu_mem * r["ram"]["recommended_ratio"]) + offload_bytes
    nv = r["nvme"]
    # full-state checkpoint: every trainable parameter's states; LoRA saves only the adapters
    ckpt = trainable * nv["checkpoint_bytes_per_param"]
    kept = int(nv["checkpoints_kept"])
    base_weights = params * 2  # bf16 safetensors each node loads at start
    dataset = tokens * nv["bytes_per_token"] // nodes
    nvme = math.ceil((ckpt * kept / nodes + dataset + base_weights) * nv["scratch_headroom"])
    return HostNeeds(
        gpu_memory_bytes=node_gpu_mem,
        ram_min_bytes=ram_min,
        ram_recommended_bytes=ram_rec,
        cores_min=r["cpu"]["min_cores_per_gpu"] * gpus_per_node,
        cores_recommended=r["cpu"]["recommended_cores_per_gpu"] * gpus_per_node,
        checkpoint_bytes=ckpt,
        checkpoints_kept=kept,
        nvme_bytes=nvme,
        multinode=nodes > 1,
    )


UNKNOWN = "unknown: run `gpuprov hosts probe`"


def _unknown(rule: str, required: str, source: str) -> HostCheck:
    """A fact nobody stated: it reads unknown and never passes."""
    return HostCheck(rule=rule, required=required, actual=UNKNOWN, ok=False, source=source, known=False)


def check_host(inst: InstanceType, needs: HostNeeds) -> list[HostCheck]:
    """Each rule against this (cloud or sized on-prem) machine: required vs actual (or unknown)."""
    r = rules()
    unknown = set(getattr(inst, "unknown", ()))
    checks: list[HostCheck] = []
    ram = inst.ram_bytes or 0
    rule = f"host RAM >= {r['ram']['min_ratio_to_gpu_memory']}x GPU memory (recommended {r['ram']['recommended_ratio']}x)"
    required = f"{gib(needs.ram_min_bytes, 0)} (recommended {gib(needs.ram_recommended_bytes, 0)})"
    checks.append(_unknown(rule, required, r["ram"]["source"]) if "ram" in unknown else HostCheck(
        rule=rule, required=required, actual=gib(ram, 0), ok=ram >= needs.ram_min_bytes, source=r["ram"]["source"]))
    cores = (inst.vcpus or 0) // 2  # clouds count SMT threads as vCPUs
    rule = f"CPU cores >= {r['cpu']['min_cores_per_gpu']} per GPU for data loading (recommended {r['cpu']['recommended_cores_per_gpu']})"
    required = f"{needs.cores_min} cores (recommended {needs.cores_recommended})"
    checks.append(_unknown(rule, required, r["cpu"]["source"]) if "cores" in unknown else HostCheck(
        rule=rule, required=required, actual=f"{cores} cores ({inst.vcpus} vCPUs)", ok=cores >= needs.cores_min,
        source=r["cpu"]["source"]))
    nvme = inst.nvme_bytes_total
    rule = (f"local NVMe for dataset share + base weights + {needs.checkpoints_kept} checkpoints "
            f"({r['nvme']['checkpoint_bytes_per_param_low']}-{r['nvme']['checkpoint_bytes_per_param']} B/param each)")
    checks.append(_unknown(rule, tb(needs.nvme_bytes), r["nvme"]["source"]) if "nvme" in unknown else HostCheck(
        rule=rule, required=tb(needs.nvme_bytes), actual=f"{tb(nvme)} ({inst.nvme_count} x {tb(inst.nvme_bytes_each)})",
        ok=nvme >= needs.nvme_bytes, source=r["nvme"]["source"]))
    checks.extend(_link_checks(inst, needs, unknown))
    return checks


def _link_checks(inst: InstanceType, needs: HostNeeds, unknown: set[str]) -> list[HostCheck]:
    """Fabric, PCIe and GPU-NIC topology: the links a multi-node run depends on."""
    r, checks = rules(), []
    net = r["network"]
    if needs.multinode:
        rule = (f"fabric >= {net['min_gbps_per_gpu_multinode']} Gb/s per GPU for multi-node "
                f"({net['recommended_gbps_per_gpu_multinode']}-{net['excellent_gbps_per_gpu_multinode']} recommended)")
        required = f"{net['min_gbps_per_gpu_multinode']} Gb/s per GPU"
        checks.append(_unknown(rule, required, net["source"]) if "fabric" in unknown else HostCheck(
            rule=rule, required=required, actual=f"{inst.fabric_gbps_per_gpu:g} Gb/s per GPU ({inst.fabric})",
            ok=inst.fabric_gbps_per_gpu >= net["min_gbps_per_gpu_multinode"], source=net["source"]))
    rule, required = f"PCIe Gen{r['pcie']['min_gen']} x16 or better per GPU", f"Gen{r['pcie']['min_gen']} x16"
    checks.append(_unknown(rule, required, r["pcie"]["source"]) if "pcie" in unknown else HostCheck(
        rule=rule, required=required, actual=f"Gen{inst.pcie_gen}", ok=inst.pcie_gen >= r["pcie"]["min_gen"],
        source=r["pcie"]["source"]))
    rule, required = "NIC and NVMe on the GPU's PCIe root (GPUDirect RDMA / Storage)", "same PCIe switch/root as the GPU"
    if unknown:  # a host of the user's: the board decides (`nvidia-smi topo -m`), nobody has looked yet
        checks.append(_unknown(rule, required, r["topology"]["source"]))
        return checks
    if inst.fabric in RDMA_FABRICS and inst.nvswitch:
        topo, ok = "HGX layout: NICs and NVMe behind the GPUs' PCIe switches (GPUDirect RDMA)", True
    elif inst.onprem:
        topo, ok = "to verify on the board: `nvidia-smi topo -m` shows PIX/PXB between each GPU and its NIC", True
    else:
        topo, ok = f"no GPUDirect RDMA path ({inst.fabric}); traffic staged through host memory", not needs.multinode
    checks.append(HostCheck(rule=rule, required=required, actual=topo, ok=ok, source=r["topology"]["source"]))
    return checks


def unknown_host_notes(inst: InstanceType, nodes: int) -> list[str]:
    """What the plan assumed about the user's hosts because the hosts file does not say."""
    unknown = list(getattr(inst, "unknown", ()))
    if not unknown:
        return []
    stateable = [k for k in unknown if k != "pcie"]
    out = []
    if stateable:
        out.append(f"Host facts nobody stated ({', '.join(stateable)}) read unknown in the checklist, not ok: run "
                   "`gpuprov hosts probe HOSTS --write` (or add ram_gib, cores, nvme_count, fabric, nic_gbps per host)")
    if "pcie" in unknown:
        out.append("PCIe generation and where each NIC and NVMe drive sits relative to its GPU read unknown: "
                   "check on the board with `nvidia-smi topo -m` (PIX/PXB between each GPU and its NIC)")
    if "fabric" in unknown and nodes > 1:
        out.append(f"The time model assumed {inst.fabric} at {inst.fabric_gbps_per_gpu:g} Gb/s per GPU between "
                   f"hosts (the hosts file states no fabric; a {inst.gpus} x {inst.gpu} server of the catalog has "
                   "it): the communication time is only as right as that guess")
    return out


def size_onprem(template: InstanceType, needs: HostNeeds) -> tuple[InstanceType, list[str]]:
    """Fill an on-prem template's host from the rules; return it and its bill of materials."""
    bom_rules = rules()["bom"]
    cpu = next((c for c in bom_rules["cpu_options"] if c["cores"] >= needs.cores_recommended),
               bom_rules["cpu_options"][-1])
    dimm = bom_rules["dimm_gib"] * GiB
    dimms = next((n for n in bom_rules["dimm_counts"] if n * dimm >= needs.ram_recommended_bytes),
                 bom_rules["dimm_counts"][-1])
    drive = int(bom_rules["nvme_drive_gb"]) * 10**9
    drives = max(int(bom_rules["nvme_min_drives"]), math.ceil(needs.nvme_bytes / drive))
    nics = template.gpus if template.fabric_gbps_per_gpu >= 200 else max(1, template.gpus // 2)
    nic_gbps = template.fabric_gbps_per_gpu * template.gpus / nics
    sized = replace(template, vcpus=cpu["cores"] * 2, ram_bytes=dimms * dimm, nvme_count=drives,
                    nvme_bytes_each=drive, network_cards=nics)
    bom = [
        f"{template.gpus}x {template.gpu} GPU ({template.description})",
        f"CPU: {cpu['part']} = {cpu['cores']} cores (>= {needs.cores_recommended} recommended for {template.gpus} GPUs)",
        f"RAM: {dimms}x {bom_rules['dimm_gib']} GiB DDR5 RDIMM = {dimms * bom_rules['dimm_gib']} GiB "
        f"(>= 2x {gib(needs.gpu_memory_bytes, 0)} GPU memory)",
        f"NVMe: {drives}x {bom_rules['nvme_drive_gb']} GB U.2/E1.S data drives in RAID0 = {tb(drives * drive)} "
        f"(needs {tb(needs.nvme_bytes)}: checkpoints + dataset share + weights)",
        f"Network: {nics}x {nic_gbps:g} Gb/s {template.fabric} NIC, each on its GPU's PCIe switch",
        f"PCIe: Gen{template.pcie_gen} x16 slot per GPU" + ("; NVSwitch baseboard (fabric manager)" if template.nvswitch else ""),
        "Boot: 2x 960 GB NVMe M.2 in RAID1 (OS, separate from the data array)",
    ]
    return sized, bom


def make_host(inst: InstanceType, needs: HostNeeds, bom: list[str] | None = None) -> Host:
    return Host(
        ram_bytes_required=needs.ram_min_bytes,
        cpu_cores_required=needs.cores_min,
        nvme_bytes_required=needs.nvme_bytes,
        checkpoint_bytes=needs.checkpoint_bytes,
        checkpoints_kept=needs.checkpoints_kept,
        checks=check_host(inst, needs),
        bill_of_materials=bom,
    )


def hosts_left_out(plan: Any) -> list[Any]:
    """The user's on-prem hosts (spec.hosts) the plan does not run on, in file order.

    The planner puts the first `nodes` hosts in plan.hosts; the rest stay listed in plan.spec.hosts
    and the plan's notes say why (see planner.hosts_note). A cloud plan leaves them all out."""
    used = {h.name for h in plan.hosts or []}
    return [h for h in plan.spec.hosts or [] if h.name not in used]
