"""Throughput model: step time of one training configuration, compute and communication.

compute  = the operations' time (gpuprov/sizing/operators.py: GEMMs by shape, FlashAttention-2, memory-bound
           ops, launches) when step_estimate gets `ops`, as the planner passes it; without, executed FLOPs
           (6N + attention, + recompute) / (dense BF16 peak x sustained utilisation of the GPU class)
comm     = bytes each GPU sends in the step's collectives (ring algorithms: (g-1)/g of the
           buffer per all-gather / reduce-scatter, twice that per all-reduce) / link bandwidth,
           NVLink (or PCIe) inside a node, the fabric's per-GPU share across nodes
exposed  = the part of comm that compute cannot hide (overlap_fraction of compute hides it)

Pure arithmetic on plain numbers (fast: the planner evaluates it tens of thousands of times).
All assumptions come from catalog/data/throughput.yaml, each with its source.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from gpuprov.catalog import load_data
from gpuprov.sizing.async_tp import async_tp_seconds
from gpuprov.sizing.nccl import fsdp_ring_seconds
from gpuprov.sizing.cp_gather import cp_gather_seconds
from gpuprov.sizing.operators import attention_forwards_again
from gpuprov.sizing.pipeline import Pipeline, pipelined  # noqa: F401  (re-exported: the planner's names)
from gpuprov.sizing.step_parts import fsdp_exposed_seconds


@dataclass(frozen=True)
class Assumptions:
    """The throughput model's constants (catalog/data/throughput.yaml), each with its source."""
    utilisation: dict[str, tuple[float, str]]  # class -> (value, source)
    class_by_slug: dict[str, str]
    class_by_arch: dict[str, str]
    qlora_factor: float
    qlora_source: str
    attn_coeff: float
    lora_base_flops_per_param: float
    param_gather_bytes: float
    grad_reduce_bytes: float
    qlora_gather_bytes: float
    overlap: float
    link_eff: dict[str, float]
    pcie_gbytes: dict[int, float]
    no_p2p_slugs: frozenset[str]
    no_p2p_factor: float
    lat_intra: float
    lat_inter: float
    opt_bytes: float
    opt_bytes_8bit: float
    f8_gather_bytes: float  # memory_constants.yaml float8 (one figure for memory and communication)
    raw: dict[str, Any]


@lru_cache(maxsize=1)
def assumptions() -> Assumptions:
    d = load_data("throughput.yaml")
    c = d["communication"]
    return Assumptions(
        utilisation={k: (float(v["value"]), v["source"]) for k, v in d["utilisation"].items()},
        class_by_slug=dict(d["class_by_slug"]),
        class_by_arch=dict(d["class_by_architecture"]),
        qlora_factor=float(d["task_speed_factor"]["qlora"]["value"]),
        qlora_source=d["task_speed_factor"]["qlora"]["source"],
        attn_coeff=float(d["flops"]["attention_flops_per_token_coeff"]),
        lora_base_flops_per_param=float(d["flops"]["lora_base_flops_per_param"]),
        param_gather_bytes=float(c["param_gather_bytes"]),
        grad_reduce_bytes=float(c["grad_reduce_bytes"]),
        qlora_gather_bytes=float(c["qlora_param_gather_bytes"]),
        overlap=float(c["overlap_fraction"]),
        link_eff={k: float(v) for k, v in c["link_efficiency"].items()},
        pcie_gbytes={int(k): float(v) for k, v in c["pcie_gbytes_per_s"].items()},
        no_p2p_slugs=frozenset(c["no_p2p_slugs"]),
        no_p2p_factor=float(c["no_p2p_factor"]),
        lat_intra=float(c["latency_s"]["intra_node"]),
        lat_inter=float(c["latency_s"]["inter_node"]),
        opt_bytes=float(d["optimizer"]["bytes_per_param"]),
        opt_bytes_8bit=float(d["optimizer"]["bytes_per_param_8bit"]),
        f8_gather_bytes=float(load_data("memory_constants.yaml")["float8"]["gather_bytes"]),
        raw=d,
    )


def gpu_class(gpu: Any) -> str:
    a = assumptions()
    if gpu.slug in a.class_by_slug:
        return a.class_by_slug[gpu.slug]
    return a.class_by_arch.get(gpu.architecture, "ada")


def power_factor(gpu: Any) -> float:
    """Sustained tensor throughput of this part relative to the power limit its class was measured at.

    Under a power cap the GPU lowers its clock until C V^2 f fits, and the voltage falls with the clock
    across the DVFS range, so the sustained clock goes as the cube root of the power limit
    (catalog/data/throughput.yaml power)."""
    power = assumptions().raw["power"]
    measured_at = power["measured_at_w"].get(gpu_class(gpu))
    tdp = getattr(gpu, "tdp_w", None)
    if not measured_at or not tdp:
        return 1.0
    return float((float(tdp) / float(measured_at)) ** float(power["clock_exponent"]))


def power_capped(gpu: Any, limit_w: int | None) -> Any:
    """The GPU as it runs under a power limit (nvidia-smi -pl) below its TDP: its `tdp_w` lowered to the
    limit, so power_factor times it at the clocks that limit holds. A limit at or above the TDP changes
    nothing (the board never draws past its TDP)."""
    import dataclasses

    if not limit_w or not getattr(gpu, "tdp_w", None) or limit_w >= gpu.tdp_w:
        return gpu
    return dataclasses.replace(gpu, tdp_w=int(limit_w))


def plan_power_limit(spec: Any) -> int | None:
    """The power limit the plan's GPUs run under: --gpu-power-limit and every on-prem host's
    power_limit_w, the lowest (the slowest GPU sets every synchronous step's pace)."""
    limits = [getattr(spec, "gpu_power_limit_w", None)]
    limits += [getattr(h, "power_limit_w", None) for h in (getattr(spec, "hosts", None) or [])]
    stated = [int(x) for x in limits if x]
    return min(stated) if stated else None


def utilisation(gpu: Any, compiled: bool = True) -> tuple[float, str]:
    """(sustained fraction of dense BF16 peak, its source) for this GPU at its power limit: the class's
    measured (compiled) value, scaled by the power limit, and by the measured eager/compiled ratio for eager."""
    value, source = assumptions().utilisation[gpu_class(gpu)]
    value *= power_factor(gpu)
    if not compiled:
        value *= float(assumptions().raw["compile"]["eager_factor"])
    return value, source


# --------------------------------------------------------------------------- float8
def float8_gain(gpu: Any, params: int) -> tuple[float, str] | None:
    """(measured float8 / bf16 tokens/s ratio for a model of `params`, its source), or None where
    no measurement covers this GPU class: log-linear between the measured sizes, clamped at the ends."""
    import math

    entry = assumptions().raw["float8"]["gain_by_class"].get(gpu_class(gpu))
    if entry is None:
        return None
    pts = [(math.log(float(b) * 1e9), float(g)) for b, g in entry["points"]]
    x = math.log(max(1, params))
    if x <= pts[0][0]:
        return pts[0][1], entry["source"]
    for (x0, g0), (x1, g1) in zip(pts, pts[1:]):
        if x <= x1:
            return g0 + (g1 - g0) * (x - x0) / (x1 - x0), entry["source"]
    return pts[-1][1], entry["source"]


def float8_refusal(*, task: str, precision: str, compiled: bool, moe: bool, tp: int) -> str | None:
    """Why the measured float8 runs do not cover this setup (catalog/data/throughput.yaml float8); None if they do."""
    f = assumptions().raw["float8"]
    why = []
    if task not in f["tasks"] or precision not in f["precisions"]:
        why.append(f"the measured float8 runs are {'/'.join(f['tasks'])} {'/'.join(f['precisions'])} training, "
                   f"not {task} {precision}")
    if f["needs_compile"] and not compiled:
        why.append("the measured float8 runs are compiled; this stack is not")
    if moe and f["dense_only"]:
        why.append("the measurements are for dense models")
    if tp > int(f["max_tp"]):
        why.append(f"the layout uses TP {tp}, beyond the float8 TP runs' {f['max_tp']} (one node)")
    return "; ".join(why) or None


def float8_linear_gain(arch: Any, step_gain: float) -> float:
    """The float8 linears' own speed-up behind a step gain measured at the runs' sequence length.

    float8 runs the linears' matmuls on FP8 tensor cores; attention (SDPA) stays bf16. The measured runs
    (seq_len and AC in catalog/data/throughput.yaml float8) spent a share `a` of their FLOPs in
    attention, so 1/step_gain = (1 - a)/linear_gain + a (Amdahl); the linear gain then applies at any
    sequence length, and long sequences, attention-heavy, gain less."""
    f = assumptions().raw["float8"]
    fl = flops_per_token(arch, int(f["measured_seq_len"]), "full", arch.params, str(f["measured_ac"]))
    a = attention_executed(fl) / fl.executed
    rest = 1.0 / step_gain - a
    return (1.0 - a) / rest if rest > 0 else step_gain


def float8_step_kw(gpu: Any, arch: Any) -> dict[str, float]:
    """step_estimate's float8 arguments for this GPU and model: the linears' speed-up behind the measured
    gain and the parameters gathered in float8 (every decoder block's linears; embeddings and head stay
    bf16); {} without a gain."""
    found = float8_gain(gpu, arch.params)
    if found is None:
        return {}
    return {"float8_gain": float8_linear_gain(arch, found[0]),
            "float8_params": arch.num_layers * arch.layer_linear_params()}


# --------------------------------------------------------------------------- FLOPs per token
@dataclass(frozen=True)
class Flops:
    """FLOPs per token of one training step: what MFU counts and what the GPUs execute."""
    model: float  # what MFU counts: 6N + attention (LoRA: 4N + 6N_lora + attention)
    executed: float  # model + recompute
    matmul_params: int
    attention: float
    recompute: float
    attention_recompute: float = 0.0  # attention forward run again in backward (full AC; op-level SAC saves it)


# A decoder block's matmuls in forward order (HF/torchtitan Llama-style blocks): attention q, k, v, o, then the
# MLP's gate (w1), up (w3) and down (w2) projections, as (input width, output width) by the arch's sizes.
def _block_matmuls(arch: Any) -> list[tuple[int, int]]:
    h, q, kv = arch.hidden_size, arch.q_dim, arch.kv_dim
    inter = arch.intermediate_size * (arch.experts_per_token if getattr(arch, "is_moe", False) else 1)
    return [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]


def sac_recompute_params(arch: Any) -> int:
    """Weights per block whose matmuls op-level selective AC runs again in backward.

    The trainer's policy (templates/launch/train_model.py selective_ac_context, torchtitan's op SAC) saves the
    SDPA output and every odd-numbered aten.mm of the block's forward, and recomputes the even-numbered
    ones (and the pointwise ops around them). LoRA adds two mms per adapted linear (lora_A, lora_B), which
    keeps the base matmuls' parity, so for every task the recomputed base matmuls are the 2nd, 4th and 6th:
    k, o and up (w3)."""
    return sum(i * o for n, (i, o) in enumerate(_block_matmuls(arch), 1) if n % 2 == 0)


def flops_per_token(arch: Any, seq_len: int, task: str, trainable: int, ac: str) -> Flops:
    a = assumptions()
    # the input embedding is a lookup, not a matmul; a tied head still multiplies by it
    n = arch.active_params - (0 if arch.tie_word_embeddings else arch.embedding_params)
    attn = a.attn_coeff * arch.num_layers * seq_len * arch.num_attention_heads * arch.attn_head_dim
    if task == "full":
        model = 6.0 * n + attn
    else:
        model = a.lora_base_flops_per_param * n + 6.0 * trainable + attn
    fwd_attn = attn / 3.0  # forward is a third of forward + backward
    attn_again = 0.0
    if ac == "full":
        recompute, attn_again = 2.0 * n + fwd_attn, fwd_attn
    elif ac == "selective":
        # op-level SAC keeps SDPA's output and every other matmul's (sac_recompute_params)
        recompute = 2.0 * arch.num_layers * sac_recompute_params(arch)
    else:
        recompute = 0.0
    return Flops(model=model, executed=model + recompute, matmul_params=n, attention=attn, recompute=recompute,
                 attention_recompute=attn_again)


def attention_executed(fl: Flops) -> float:
    """Attention FLOPs the step runs (forward + backward, + the forward again under full AC): what float8 leaves
    bf16."""
    return fl.attention + fl.attention_recompute


# --------------------------------------------------------------------------- links
def intra_node_gbytes(gpu: Any, fabric: str | None = None) -> tuple[float, str]:
    """Achievable GB/s per GPU for collectives inside one node, and which link it is."""
    a = assumptions()
    if gpu.nvlink_gbytes_per_s:
        return gpu.nvlink_gbytes_per_s * a.link_eff["nvlink"], "NVLink"
    bw = a.pcie_gbytes.get(int(gpu.pcie_gen), 16.0) * a.link_eff["pcie"]
    if gpu.slug in a.no_p2p_slugs:
        return bw * a.no_p2p_factor, f"PCIe Gen{gpu.pcie_gen} (no P2P: via host memory)"
    return bw, f"PCIe Gen{gpu.pcie_gen}"


def inter_node_gbytes(fabric: str, gbps_per_gpu: float) -> float:
    return gbps_per_gpu / 8.0 * assumptions().link_eff.get(fabric, 0.5)


# --------------------------------------------------------------------------- the step
@dataclass(frozen=True)
class StepEstimate:
    """One optimizer step's time, split into compute and communication."""
    step_time_s: float
    compute_time_s: float  # all micro-batches
    comm_time_s: float  # total collective time (before overlap)
    exposed_comm_s: float  # what the step pays for
    optimizer_time_s: float
    tokens_per_s: float  # whole cluster
    mfu: float  # model FLOPs / (peak x GPUs x time)
    utilisation: float
    comm_bytes_per_gpu: float
    bound: str  # compute | communication
    terms: dict[str, float]  # named pieces for `gpuprov explain`


@dataclass(frozen=True)
class Shape:
    """Cluster + parallel shape of one candidate (plain numbers; no catalog objects)."""

    nodes: int
    gpus_per_node: int
    sharding: str  # none, ddp, zero2, fsdp, hsdp
    shard_group: int
    micro_batch: int
    grad_accum: int
    seq_len: int

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def _collective_bw(group: int, gpus_per_node: int, intra: float, inter: float) -> tuple[float, float]:
    """(bus GB/s, latency s) of a ring over `group` consecutive ranks (spans nodes if group > node).

    `inter` is one GPU's share of its node's fabric. NCCL builds one ring per channel and gives each
    channel its own NIC, so a ring that spans nodes crosses every node boundary on all the NICs of the
    node's ranks at once: the bus bandwidth is channels x one NIC (NVIDIA/nccl src/graph/tuning.cc
    `busBw = nChannels * bw`, bw = bwInter beyond two nodes), i.e. the node's aggregate for the ranks it
    has in the group, never more than NVLink inside the node. FSDP's per-layer collectives are timed from it
    message by message as NCCL's tuning model does (gpuprov/sizing/nccl.py); the latency is the others'."""
    a = assumptions()
    if group <= gpus_per_node:
        return intra, a.lat_intra
    return min(intra, inter * gpus_per_node), a.lat_inter


@dataclass(frozen=True)
class _Comm:
    """Collective time of one step by where it can hide, and the bytes a GPU sends."""

    per_micro_batch: float = 0.0  # hides under each micro-batch's compute
    per_step_sync: float = 0.0  # hides under the last backward only
    tail: float = 0.0  # after the optimizer step: cannot hide
    volume: float = 0.0


def _gather_and_reduce_bytes(a: Assumptions, prec: dict[str, Any], task: str, params: int, trainable: int,
                             float8_params: int) -> tuple[float, float]:
    """(bytes in one full copy of what FSDP gathers, bytes in one full copy of the reduced gradients)."""
    param_bytes = float(prec["gather_bytes"])
    gather_bytes = a.qlora_gather_bytes if task == "qlora" else param_bytes
    frozen = params - trainable if task != "full" else 0
    gather_buf = params * gather_bytes if task == "full" else frozen * gather_bytes + trainable * param_bytes
    if float8_params:
        gather_buf -= float8_params * (param_bytes - a.f8_gather_bytes)
    return gather_buf, trainable * float(prec["reduce_bytes"])


def _data_parallel_comm(shape: Shape, gather_buf: float, grad_buf: float, trainable_bytes: float, num_layers: int,
                        intra: float, inter: float) -> _Comm:
    """FSDP/HSDP, ZeRO-2 or DDP collectives of one step, ring algorithms over the group's links."""
    n, s = shape.total_gpus, shape.sharding
    if s in ("fsdp", "hsdp") and shape.shard_group > 1:
        g = shape.shard_group
        bw, gpn = _collective_bw(g, shape.gpus_per_node, intra, inter)[0], shape.gpus_per_node
        b = (g - 1) / g * (2 * gather_buf + grad_buf)  # all-gather, re-gather (reshard_after_forward), reduce-scatter
        ring = fsdp_ring_seconds(gather_buf, grad_buf, num_layers, g, gpn, bw, intra)
        out = _Comm(per_micro_batch=ring, volume=b * shape.grad_accum)
        if s == "hsdp" and n > g:
            r = n // g
            bw_r, lat_r = _collective_bw(n, shape.gpus_per_node, intra, inter)
            # replicas all-reduce their shard of the grads once per step (ranks of one replica
            # group sit on different nodes, one per node: one NIC each carries it)
            b_r = 2 * (r - 1) / r * grad_buf / g
            out = replace(out, volume=out.volume + b_r,
                          per_step_sync=b_r / (min(bw_r, inter) * 1e9) + num_layers * lat_r)
        return out
    if s == "zero2" and n > 1:
        bw, lat = _collective_bw(n, shape.gpus_per_node, intra, inter)
        b_rs = (n - 1) / n * grad_buf
        b_ag = (n - 1) / n * trainable_bytes  # updated params after the step
        return _Comm(per_micro_batch=b_rs / (bw * 1e9) + num_layers * lat, tail=b_ag / (bw * 1e9) + lat,
                     volume=b_rs * shape.grad_accum + b_ag)
    if s == "ddp" and n > 1:
        bw, lat = _collective_bw(n, shape.gpus_per_node, intra, inter)
        b = 2 * (n - 1) / n * grad_buf  # no_sync during accumulation: one all-reduce per step
        return _Comm(per_step_sync=b / (bw * 1e9) + num_layers * lat, volume=b)
    return _Comm()


def _local_shards(shape: Shape, params: int, trainable: int) -> tuple[float, float]:
    """(trainable params this GPU's optimizer steps, params this GPU stores)."""
    if shape.sharding in ("fsdp", "hsdp"):
        return trainable / max(1, shape.shard_group), params / max(1, shape.shard_group)
    if shape.sharding == "zero2":
        return trainable / shape.total_gpus, params
    return trainable, params


def _optimizer_seconds(shard: float, optimizer: str, offload: str, hbm_gbytes_per_s: float, host_gbytes: float) -> float:
    """AdamW over this GPU's shard: HBM-bound on the GPU, or host-side after shipping grads down and
    params up when offloaded."""
    a = assumptions()
    off = a.raw["offload"]
    if offload in ("optimizer", "full"):
        return shard / float(off["cpu_adam_params_per_s_per_gpu"]) + \
            shard * float(off["host_link_bytes_per_param_per_step"]) / (host_gbytes * 1e9)
    opt_bytes = a.opt_bytes_8bit if optimizer == "adamw-8bit" else a.opt_bytes
    return shard * opt_bytes / (hbm_gbytes_per_s * 1e9)


def compute_seconds(tokens: float, flops: Flops, peak_tflops: float, speed: float, float8_gain: float = 1.0) -> float:
    """Seconds `tokens` take at `speed` x peak; float8 speeds up the linears' matmuls, not attention."""
    attn = attention_executed(flops) if float8_gain != 1.0 else 0.0
    work = (flops.executed - attn) / float8_gain + attn
    return tokens * work / (peak_tflops * 1e12 * speed)


def _operation_terms(ops: Any, shape: Shape, mp: tuple[int, int, int], float8_gain: float, fsdp_params: int,
                     peak_fraction: float, gemm_chunks: int, repeats: int) -> dict[str, float]:
    """One micro-batch's compute, operation by operation, for the (tp, cp, pp) layout `mp`."""
    tp, cp, pp = mp
    return ops.terms(micro_batch=shape.micro_batch, seq_len=shape.seq_len * cp, tp=tp, cp=cp, pp=pp,
                     float8_gain=float8_gain, fsdp_params=fsdp_params, peak_fraction=peak_fraction,
                     gemm_chunks=gemm_chunks, repeats=repeats)


def _executed(flops: Flops, ops: Any, seq: int, cp: int) -> float:
    """FLOPs per token the operations execute: a masked kernel's whole square and the forwards CP's gather
    checkpoint runs again included (what "N% of peak on the work it executes" divides by)."""
    factor = ops.attention_work_factor(seq, cp)
    again = attention_forwards_again(ops.ac, ops.gathers(cp)) - attention_forwards_again(ops.ac, False)
    return flops.executed + attention_executed(flops) * (factor - 1.0) + flops.attention / 3.0 * again * factor


def step_estimate(
    *,
    shape: Shape,
    flops: Flops,
    peak_tflops: float,
    util: float,
    hbm_gbytes_per_s: float,
    intra_gbytes: float,
    inter_gbytes: float,
    params: int,
    trainable: int,
    num_layers: int,
    task: str,
    optimizer: str = "adamw",
    precision: str = "bf16-mixed",
    offload: str = "none",
    pcie_gen: int = 4,
    float8_gain: float = 1.0,
    float8_params: int = 0,
    ops: Any = None,
    mp: tuple[int, int, int] = (1, 1, 1),
    gemm_chunks: int = 1,
    pp_micro_batches: int = 1,
) -> StepEstimate:
    """`float8_gain` > 1: torchao float8 linears (their matmuls' speed-up, float8_step_kw);
    `float8_params` of the parameters are then all-gathered in float8 (1 byte each).
    `ops` (gpuprov.sizing.operators.OpModel): compute is timed operation by operation (GEMMs by shape,
    attention, memory-bound ops, launches) for the (tp, cp, pp) layout `mp` the shape stands for; without
    it, executed FLOPs at `util` x peak."""
    a = assumptions()
    prec = a.raw["precision"][precision]
    n = shape.total_gpus
    speed = util * (a.qlora_factor if task == "qlora" else 1.0) * float(prec["peak_fraction"])
    tokens_mb = shape.micro_batch * shape.seq_len
    op_terms: dict[str, float] = {}
    if ops is not None:
        fsdp = params if shape.sharding in ("fsdp", "hsdp") and shape.shard_group > 1 else 0
        op_terms = _operation_terms(ops, shape, mp, float8_gain, fsdp, float(prec["peak_fraction"]), gemm_chunks,
                                    pp_micro_batches)
        compute_mb = sum(op_terms.values())
        speed = tokens_mb * _executed(flops, ops, shape.seq_len * mp[1], mp[1]) / (peak_tflops * 1e12 * compute_mb)
    else:
        compute_mb = compute_seconds(tokens_mb, flops, peak_tflops, speed, float8_gain)
    compute = compute_mb * shape.grad_accum

    gather_buf, grad_buf = _gather_and_reduce_bytes(a, prec, task, params, trainable, float8_params)
    comm = _data_parallel_comm(shape, gather_buf, grad_buf, trainable * float(prec["gather_bytes"]), num_layers,
                               intra_gbytes, inter_gbytes)
    shard, param_shard = _local_shards(shape, params, trainable)
    host_gbytes = a.pcie_gbytes.get(int(pcie_gen), 16.0) * a.link_eff["pcie"]
    per_mb_comm = comm.per_micro_batch
    if offload == "full":
        # parameters live on the host: every micro-batch brings the shard up twice, grads down
        per_mb_comm += param_shard * float(a.raw["offload"]["full_offload_bytes_per_param_per_micro_batch"]) / (host_gbytes * 1e9)
    if ops is not None and offload != "full" and shape.sharding in ("fsdp", "hsdp") and comm.per_micro_batch:
        exposed_mb = fsdp_exposed_seconds(per_mb_comm, compute_mb, gather_buf, grad_buf, num_layers // mp[2] or 1)
    else:
        exposed_mb = max(0.0, per_mb_comm - a.overlap * compute_mb)
    # the step's gradient sync hides under the last backward only, in what that micro-batch's own
    # collectives left of it: one stretch of compute cannot hide two transfers at once
    left = max(0.0, a.overlap * compute_mb - per_mb_comm)
    exposed_sync = max(0.0, comm.per_step_sync - min(left, a.overlap * compute_mb * 2.0 / 3.0))
    exposed = exposed_mb * shape.grad_accum + exposed_sync + comm.tail
    opt = _optimizer_seconds(shard, optimizer, offload, hbm_gbytes_per_s, host_gbytes)

    step = compute + exposed + opt
    tps = tokens_mb * shape.grad_accum * n / step
    terms = {"compute_per_micro_batch_s": compute_mb, "comm_per_micro_batch_s": per_mb_comm,
             "exposed_per_micro_batch_s": exposed_mb, "sync_per_step_s": comm.per_step_sync,
             "exposed_sync_s": exposed_sync, "tail_s": comm.tail, "optimizer_s": opt}
    terms.update({f"{k[:-2]}_per_micro_batch_s": v for k, v in op_terms.items()}, micro_batches=shape.grad_accum)
    return StepEstimate(
        step_time_s=step, compute_time_s=compute,
        comm_time_s=per_mb_comm * shape.grad_accum + comm.per_step_sync + comm.tail, exposed_comm_s=exposed,
        optimizer_time_s=opt, tokens_per_s=tps, mfu=tps * flops.model / (peak_tflops * 1e12 * n), utilisation=speed,
        comm_bytes_per_gpu=comm.volume, bound="communication" if exposed > 0.25 * compute else "compute", terms=terms,
    )


# --------------------------------------------------------------------------- tensor / context parallel
@dataclass(frozen=True)
class LayerShape:
    """What the TP and CP collectives move per layer (plain numbers)."""

    num_layers: int
    hidden: int
    kv_width: int  # K/V width as SDPA sees it (GQA repeated to the query heads)
    projected_kv_width: int = 0  # GQA not repeated: what the trainer's CP all-gather moves (0: kv_width)


def tp_gpu_seconds_per_token(*, layer: LayerShape, tp: int, ac: str, gbytes: float, float8: bool = False) -> float:
    """GPU-seconds one token costs in TP collectives (all tp GPUs wait), latency left out: a lower bound
    (with `float8`, the float8 all-gathers of float8 linears)."""
    return tp * tp_comm_seconds(tokens=1.0, layer=layer, tp=tp, ac=ac, gbytes=gbytes, latency=0.0, float8=float8)


def tp_comm_seconds(*, tokens: float, layer: LayerShape, tp: int, ac: str, gbytes: float, latency: float,
                    float8: bool = False) -> float:
    """Per micro-batch: the TP(+SP) collectives of every layer, on the critical path.

    `tokens` is the micro-batch's tokens on this GPU's CP rank (micro_batch x seq / cp). Each all-reduce-sized
    call is an all-gather plus a reduce-scatter of the layer's activation. With float8 linears (torchao
    torchao/float8/float8_tensor_parallel.py@7698af73e7d3b41208ea86b2c43ac6bb015ae90c) the all-gathers move
    float8: PrepareFloat8ModuleInput casts the attention and MLP inputs before gathering them, and
    Float8RowwiseParallel's NoopFwToFloat8BwDynamic casts the output gradient before its backward all-gather;
    the reduce-scatters of partial sums stay bf16."""
    if tp == 1:
        return 0.0
    mp = assumptions().raw["model_parallel"]
    calls = mp["tp_allreduces_forward_per_layer"] + mp["tp_allreduces_backward_per_layer"]
    if ac in ("selective", "full"):
        calls += mp["tp_allreduces_forward_per_layer"]  # recompute re-gathers the forward's inputs
    gather_bytes = float(assumptions().f8_gather_bytes) if float8 else 2.0
    per_call = tokens * layer.hidden * (gather_bytes + 2.0)  # all-gather + bf16 reduce-scatter
    per_layer = calls * (tp - 1) / tp * per_call / (gbytes * 1e9) + 2 * calls * latency
    return float(mp["tp_exposed_fraction"]) * per_layer * layer.num_layers


def cp_comm_seconds(*, tokens: float, layer: LayerShape, tp: int, cp: int, gbytes: float, latency: float) -> float:
    """Per micro-batch: ring attention's K/V (and dK/dV) exchange, cp - 1 hops per pass."""
    if cp == 1:
        return 0.0
    mp = assumptions().raw["model_parallel"]
    kv = 2.0 * layer.kv_width / tp * tokens  # local K and V elements
    per_pass = (cp - 1) * kv
    volume = per_pass * 2.0 * (mp["cp_kv_passes_forward"] + mp["cp_kv_passes_backward"])
    volume += per_pass * float(mp["cp_dkv_bytes"])
    return layer.num_layers * (volume / (gbytes * 1e9) + 3 * (cp - 1) * latency)


def cp_exposed_seconds(*, tokens: float, layer: LayerShape, tp: int, cp: int, gbytes: float, latency: float,
                       attn_fwd_s: float, attn_bwd_s: float, recompute: bool) -> float:
    """Per micro-batch: the part of ring attention's exchange its own SDPA calls cannot hide, as torch runs it
    (torch 2.13 torch/distributed/tensor/experimental/_context_parallel/_attention.py).

    Forward (`_templated_ring_attention`, default rotate method ALL_GATHER): one all-gather of every rank's
    K/V is launched before the first (local) chunk's SDPA and waited for before the second, so only that
    chunk (1/cp of the layer's attention) hides it; full AC runs the forward again. Backward
    (`_templated_ring_attention_backward`): the K/V all-gather again behind the first chunk, then each
    step sends its fp32 dK/dV to the next rank (ALL_TO_ALL permute) and waits for it after the next step's
    SDPA backward, so cp - 1 hops hide behind one chunk each and the last is waited for after the loop.
    `attn_fwd_s` / `attn_bwd_s`: the layer's attention forward / backward time on this rank."""
    if cp == 1:
        return 0.0
    kv = 2.0 * layer.kv_width / tp * tokens  # local K and V elements
    gather = (cp - 1) * kv * 2.0 / (gbytes * 1e9) + (cp - 1) * latency  # bf16, ring all-gather
    hop = kv * 4.0 / (gbytes * 1e9) + latency  # fp32 dK/dV to the next rank
    fwd = max(0.0, gather - attn_fwd_s / cp) * (2 if recompute else 1)
    bwd = max(0.0, gather - attn_bwd_s / cp) + (cp - 1) * max(0.0, hop - attn_bwd_s / cp) + hop
    return layer.num_layers * (fwd + bwd)


def cp_merge_seconds(*, tokens: float, layer: LayerShape, tp: int, cp: int, recompute: bool,
                     hbm_gbytes_per_s: float) -> float:
    """Per micro-batch: ring attention's memory-bound work between its SDPA calls, HBM bytes / bandwidth.

    torch merges each round's partial output into an fp32 running output with the logsumexp rescale, and in
    backward accumulates dq/dK/dV in fp32 and concatenates dK/dV for the next rank every round
    (catalog/data/throughput.yaml model_parallel.cp_ring_memory_bytes, counted op by op for the rank that
    runs the full local q every round). These run on the compute stream: nothing hides them. `tokens` is
    the rank's local tokens; q/out are `hidden` wide (query heads x head dim), K/V `kv_width`."""
    if cp == 1:
        return 0.0
    b = assumptions().raw["model_parallel"]["cp_ring_memory_bytes"]
    eq, ekv = tokens * layer.hidden / tp, tokens * layer.kv_width / tp  # elements of one q-sized / K-sized tensor
    fwd = (2 * ekv * b["kv_concat_per_kv"] * (cp - 1) + eq * b["out_to_fp32_per_q"] * cp
           + eq * b["merge_per_q"] * (cp - 1) + eq * b["out_to_bf16_per_q"])
    bwd = (eq * (b["grad_zeros_per_q"] + b["grad_to_bf16_per_q"] + b["dq_add_per_q"] * cp)
           + 2 * ekv * (b["grad_zeros_per_kv"] + b["kv_concat_per_kv"] * (cp - 1) + b["grad_add_first_per_kv"]
                        + b["grad_add_partial_per_kv"] * (cp - 1) + b["dkv_concat_per_kv"] * cp
                        + b["grad_to_bf16_per_kv"]))
    return layer.num_layers * (fwd * (2 if recompute else 1) + bwd) / (hbm_gbytes_per_s * 1e9)


def _cp_exposed(kw: dict[str, Any], compute_mb: float, tokens: float, layer: LayerShape, tp: int, cp: int, ac: str,
                gbytes: float, latency: float, attn_s: float | None = None) -> float:
    """cp_exposed_seconds with the layer's attention time split out of the micro-batch's compute time
    (attention stays bf16 under float8; backward is twice the forward's FLOPs)."""
    if cp == 1:
        return 0.0
    if attn_s is not None:  # the operation model's FlashAttention time: forward 1, backward 2.5 (+1 under full AC)
        fwd = attn_s / (4.5 if ac == "full" else 3.5) / layer.num_layers
        return cp_exposed_seconds(tokens=tokens, layer=layer, tp=tp, cp=cp, gbytes=gbytes, latency=latency,
                                  attn_fwd_s=fwd, attn_bwd_s=2.5 * fwd, recompute=ac == "full")
    fl: Flops = kw["flops"]
    attn = attention_executed(fl)
    work = (fl.executed - attn) / float(kw.get("float8_gain", 1.0)) + attn
    fwd = compute_mb * (fl.attention / 3.0) / work / layer.num_layers
    return cp_exposed_seconds(tokens=tokens, layer=layer, tp=tp, cp=cp, gbytes=gbytes, latency=latency,
                              attn_fwd_s=fwd, attn_bwd_s=2.0 * fwd, recompute=ac == "full")


def layout_step_estimate(*, shape: Shape, tp: int, cp: int, layer: LayerShape, ac: str, peak_tflops: float,
                         intra_gbytes: float, inter_gbytes: float, params: int, trainable: int,
                         pipeline: Pipeline | None = None, async_tp: bool = False, **kw: Any) -> StepEstimate:
    """step_estimate for a (tp, cp, pp) layout: torchtitan's FSDP over dp x cp with TP inside the node.

    A TP x PP group acts as one data-parallel rank with tp x pp the FLOPs and 1/(tp pp) of the parameters
    to gather and reduce (FSDP shards the TP shards of its stage); a CP rank sees seq/cp tokens per sample.
    FSDP's collectives then run over the dp x cp ranks, gpus_per_node / tp of them per node; TP's
    per-layer collectives (NVLink, exposed) and what CP's ring exposes past its own SDPA chunks are added per
    micro-batch; async TP (torchtitan enable_async_tensor_parallel: the matmuls are split so each collective
    runs under the matmul of the previous chunk) hides them as FSDP's are hidden. With PP, FSDP keeps the
    stage unsharded through the step (torchtitan turns reshard_after_forward off), so the data-parallel
    collectives run once per step (the shape's micro_batch is the local batch the schedule splits), and
    the schedule's bubble idles the stage for Pipeline.bubble() of its compute and exposed TP time.
    """
    pp = pipeline.stages if pipeline else 1
    if tp * cp * pp == 1:
        return step_estimate(shape=shape, peak_tflops=peak_tflops, intra_gbytes=intra_gbytes,
                             inter_gbytes=inter_gbytes, params=params, trainable=trainable, **kw)
    a = assumptions()
    virtual = Shape(nodes=shape.nodes, gpus_per_node=max(1, shape.gpus_per_node // tp), sharding=shape.sharding,
                    shard_group=max(1, shape.shard_group // (tp * pp)), micro_batch=shape.micro_batch,
                    grad_accum=shape.grad_accum, seq_len=shape.seq_len // cp)
    kw_rank = dict(kw, float8_params=int(kw.get("float8_params", 0)) // (tp * pp))  # the rank's float8 shard
    base = step_estimate(shape=virtual, peak_tflops=peak_tflops * tp * pp, intra_gbytes=intra_gbytes,
                         inter_gbytes=inter_gbytes, params=params // (tp * pp), trainable=trainable // (tp * pp),
                         mp=(tp, cp, pp), gemm_chunks=tp if async_tp else 1,
                         pp_micro_batches=pipeline.micro_batches if pipeline else 1, **kw_rank)
    tokens = shape.micro_batch * shape.seq_len / cp
    stage_layer = replace(layer, num_layers=-(-layer.num_layers // pp))
    # float8 linears (a float8 gain) run torchao's Float8Colwise/RowwiseParallel: float8 all-gathers
    f8 = float(kw.get("float8_gain", 1.0)) != 1.0
    tp_s = tp_comm_seconds(tokens=tokens, layer=stage_layer, tp=tp, ac=ac, gbytes=intra_gbytes, latency=a.lat_intra,
                           float8=f8)
    ring_intra = tp * cp <= shape.gpus_per_node
    cp_bw = intra_gbytes if ring_intra else min(intra_gbytes, inter_gbytes)
    cp_lat = a.lat_intra if ring_intra else a.lat_inter
    compute_mb = base.terms["compute_per_micro_batch_s"]
    ops = kw.get("ops")
    if ops is not None and ops.gathers(cp):  # gpuprov's trainer on packed documents: all-gathers, no ring
        cp_s, cp_merge = cp_gather_seconds(tokens=tokens, layer=stage_layer, tp=tp, cp=cp, gbytes=cp_bw,
                                              latency=cp_lat, ac=ac, hbm_gbytes_per_s=float(kw["hbm_gbytes_per_s"]))
        cp_exposed = cp_s
    else:
        cp_s = cp_comm_seconds(tokens=tokens, layer=stage_layer, tp=tp, cp=cp, gbytes=cp_bw, latency=cp_lat)
        cp_exposed = _cp_exposed(kw, compute_mb, tokens, stage_layer, tp, cp, ac, cp_bw, cp_lat,
                                 base.terms.get("attention_per_micro_batch_s"))
        cp_merge = cp_merge_seconds(tokens=tokens, layer=stage_layer, tp=tp, cp=cp, recompute=ac == "full",
                                    hbm_gbytes_per_s=float(kw["hbm_gbytes_per_s"]))
    tp_exposed, tp_reduce = tp_s, 0.0
    if async_tp and "gemm_per_micro_batch_s" in base.terms:
        tp_exposed, tp_reduce = async_tp_seconds(tp_s, base.terms["gemm_per_micro_batch_s"], tokens=tokens,
                                                 layer=stage_layer, tp=tp, ac=ac, float8=f8, hbm=kw["hbm_gbytes_per_s"])
    elif async_tp:
        tp_exposed = max(0.0, tp_s - a.overlap * compute_mb)
    extra = (tp_exposed + cp_exposed) * shape.grad_accum
    on_stream = (cp_merge + tp_reduce) * shape.grad_accum  # the merges and reductions run on the compute stream
    compute = base.compute_time_s + on_stream
    bubble = pipeline.bubble() * (compute + tp_exposed * shape.grad_accum) if pipeline else 0.0
    step = base.step_time_s + on_stream + extra + bubble
    exposed = base.exposed_comm_s + extra
    terms = dict(base.terms, tp_comm_per_micro_batch_s=tp_s, tp_exposed_per_micro_batch_s=tp_exposed,
                 cp_ring_per_micro_batch_s=cp_s, cp_exposed_per_micro_batch_s=cp_exposed, pipeline_bubble_s=bubble,
                 cp_merge_per_micro_batch_s=cp_merge, async_tp_reduce_per_micro_batch_s=tp_reduce)
    return StepEstimate(
        step_time_s=step, compute_time_s=compute, comm_time_s=base.comm_time_s + (tp_s + cp_s) * shape.grad_accum,
        exposed_comm_s=exposed, optimizer_time_s=base.optimizer_time_s,
        tokens_per_s=base.tokens_per_s / pp * base.step_time_s / step,  # the pp stages share one replica's tokens
        mfu=base.mfu * base.step_time_s / step, utilisation=base.utilisation,
        comm_bytes_per_gpu=base.comm_bytes_per_gpu, bound="communication" if exposed > 0.25 * compute else "compute",
        terms=terms,
    )
