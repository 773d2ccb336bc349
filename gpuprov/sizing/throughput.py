"""Throughput model: step time of one training configuration, compute and communication.

compute  = executed FLOPs (6N + attention, + recompute under activation checkpointing)
           / (dense BF16 peak x sustained utilisation of the GPU class)
comm     = bytes each GPU sends in the step's collectives (ring algorithms: (g-1)/g of the
           buffer per all-gather / reduce-scatter, twice that per all-reduce) / link bandwidth,
           NVLink (or PCIe) inside a node, the fabric's per-GPU share across nodes
exposed  = the part of comm that compute cannot hide (overlap_fraction of compute hides it)

Pure arithmetic on plain numbers (fast: the planner evaluates it tens of thousands of times).
All assumptions come from catalog/data/throughput.yaml, each with its source.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from gpuprov.catalog import load_data


@dataclass(frozen=True)
class Assumptions:
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


def utilisation(gpu: Any) -> tuple[float, str]:
    """(assumed sustained fraction of dense BF16 peak, its source) for this GPU."""
    return assumptions().utilisation[gpu_class(gpu)]


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
        why.append(f"the layout uses TP {tp} (the trainer converts linears after TP)")
    return "; ".join(why) or None


def float8_step_kw(gpu: Any, arch: Any) -> dict[str, float]:
    """step_estimate's float8 arguments for this GPU and model: the measured gain and the parameters
    gathered in float8 (every decoder block's linears; embeddings and head stay bf16); {} without a gain."""
    found = float8_gain(gpu, arch.params)
    if found is None:
        return {}
    return {"float8_gain": found[0], "float8_params": arch.num_layers * arch.layer_linear_params()}


# --------------------------------------------------------------------------- FLOPs per token
@dataclass(frozen=True)
class Flops:
    model: float  # what MFU counts: 6N + attention (LoRA: 4N + 6N_lora + attention)
    executed: float  # model + recompute
    matmul_params: int
    attention: float
    recompute: float


def flops_per_token(arch: Any, seq_len: int, task: str, trainable: int, ac: str) -> Flops:
    a = assumptions()
    # the input embedding is a lookup, not a matmul; a tied head still multiplies by it
    n = arch.active_params - (0 if arch.tie_word_embeddings else arch.embedding_params)
    attn = a.attn_coeff * arch.num_layers * seq_len * arch.num_attention_heads * arch.head_dim
    if task == "full":
        model = 6.0 * n + attn
    else:
        model = a.lora_base_flops_per_param * n + 6.0 * trainable + attn
    fwd_attn = attn / 3.0  # forward is a third of forward + backward
    if ac == "full":
        recompute = 2.0 * n + fwd_attn
    elif ac == "selective":
        recompute = fwd_attn
    else:
        recompute = 0.0
    return Flops(model=model, executed=model + recompute, matmul_params=n, attention=attn, recompute=recompute)


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
    """(GB/s, latency s) of a ring over `group` consecutive ranks (spans nodes if group > node)."""
    a = assumptions()
    if group <= gpus_per_node:
        return intra, a.lat_intra
    return min(intra, inter), a.lat_inter


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
) -> StepEstimate:
    """`float8_gain` > 1: torchao float8 linears (measured speed-up on the step's compute);
    `float8_params` of the parameters are then all-gathered in float8 (1 byte each)."""
    a = assumptions()
    prec = a.raw["precision"][precision]
    n = shape.total_gpus
    speed = util * (a.qlora_factor if task == "qlora" else 1.0) * float(prec["peak_fraction"]) * float8_gain
    tokens_mb = shape.micro_batch * shape.seq_len
    compute_mb = tokens_mb * flops.executed / (peak_tflops * 1e12 * speed)
    compute = compute_mb * shape.grad_accum

    param_bytes = float(prec["gather_bytes"])
    gather_bytes = a.qlora_gather_bytes if task == "qlora" else param_bytes
    frozen = params - trainable if task != "full" else 0
    # bytes in one full copy of what is gathered / reduced
    gather_buf = params * gather_bytes if task == "full" else frozen * gather_bytes + trainable * param_bytes
    if float8_params:
        gather_buf -= float8_params * (param_bytes - a.f8_gather_bytes)
    grad_buf = trainable * float(prec["reduce_bytes"])

    per_mb_comm = 0.0  # hides under each micro-batch's compute
    per_step_sync = 0.0  # hides under the last backward only
    tail = 0.0  # after the optimizer step: cannot hide
    vol = 0.0
    s = shape.sharding
    if s in ("fsdp", "hsdp") and shape.shard_group > 1:
        g = shape.shard_group
        bw, lat = _collective_bw(g, shape.gpus_per_node, intra_gbytes, inter_gbytes)
        frac = (g - 1) / g
        # forward all-gather + backward re-gather (reshard_after_forward) + grad reduce-scatter
        b = frac * (2 * gather_buf + grad_buf)
        vol += b * shape.grad_accum
        per_mb_comm = b / (bw * 1e9) + 3 * num_layers * lat
        if s == "hsdp" and shape.nodes * shape.gpus_per_node > g:
            r = n // g
            bw_r, lat_r = _collective_bw(n, shape.gpus_per_node, intra_gbytes, inter_gbytes)
            # replicas all-reduce their shard of the grads once per step (ranks of one replica
            # group sit on different nodes: the fabric carries it)
            b_r = 2 * (r - 1) / r * grad_buf / g
            vol += b_r
            per_step_sync = b_r / (min(bw_r, inter_gbytes) * 1e9) + num_layers * lat_r
    elif s == "zero2" and n > 1:
        bw, lat = _collective_bw(n, shape.gpus_per_node, intra_gbytes, inter_gbytes)
        frac = (n - 1) / n
        b_rs = frac * grad_buf
        vol += b_rs * shape.grad_accum
        per_mb_comm = b_rs / (bw * 1e9) + num_layers * lat
        b_ag = frac * trainable * param_bytes  # updated params after the step
        vol += b_ag
        tail = b_ag / (bw * 1e9) + lat
    elif s == "ddp" and n > 1:
        bw, lat = _collective_bw(n, shape.gpus_per_node, intra_gbytes, inter_gbytes)
        b = 2 * (n - 1) / n * grad_buf  # no_sync during accumulation: one all-reduce per step
        vol += b
        per_step_sync = b / (bw * 1e9) + num_layers * lat
    # CPU offload: the host link (PCIe) carries what the optimizer and the offloaded shards need
    if s in ("fsdp", "hsdp"):
        shard = trainable / max(1, shape.shard_group)
        param_shard = params / max(1, shape.shard_group)
    elif s == "zero2":
        shard, param_shard = trainable / n, params
    else:
        shard, param_shard = trainable, params
    host_gbytes = a.pcie_gbytes.get(int(pcie_gen), 16.0) * a.link_eff["pcie"]
    off = a.raw["offload"]
    if offload == "full":
        # parameters live on the host: every micro-batch brings the shard up twice, grads down
        per_mb_comm += param_shard * float(off["full_offload_bytes_per_param_per_micro_batch"]) / (host_gbytes * 1e9)
    exposed_mb = max(0.0, per_mb_comm - a.overlap * compute_mb)
    backward_last = compute_mb * 2.0 / 3.0
    exposed_sync = max(0.0, per_step_sync - a.overlap * backward_last)
    exposed = exposed_mb * shape.grad_accum + exposed_sync + tail
    comm = per_mb_comm * shape.grad_accum + per_step_sync + tail

    # optimizer step over this GPU's shard of the trainable parameters: HBM-bound on the GPU, or
    # host-side after shipping grads down and params up when offloaded
    if offload in ("optimizer", "full"):
        opt = shard / float(off["cpu_adam_params_per_s_per_gpu"]) + \
            shard * float(off["host_link_bytes_per_param_per_step"]) / (host_gbytes * 1e9)
    else:
        opt_bytes = a.opt_bytes_8bit if optimizer == "adamw-8bit" else a.opt_bytes
        opt = shard * opt_bytes / (hbm_gbytes_per_s * 1e9)

    step = compute + exposed + opt
    tokens_step = tokens_mb * shape.grad_accum * n
    tps = tokens_step / step
    mfu = tps * flops.model / (peak_tflops * 1e12 * n)
    bound = "communication" if exposed > 0.25 * compute else "compute"
    terms = {
        "compute_per_micro_batch_s": compute_mb,
        "comm_per_micro_batch_s": per_mb_comm,
        "exposed_per_micro_batch_s": exposed_mb,
        "sync_per_step_s": per_step_sync,
        "exposed_sync_s": exposed_sync,
        "tail_s": tail,
        "optimizer_s": opt,
    }
    return StepEstimate(
        step_time_s=step, compute_time_s=compute, comm_time_s=comm, exposed_comm_s=exposed,
        optimizer_time_s=opt, tokens_per_s=tps, mfu=mfu, utilisation=speed,
        comm_bytes_per_gpu=vol, bound=bound, terms=terms,
    )


# --------------------------------------------------------------------------- tensor / context parallel
@dataclass(frozen=True)
class LayerShape:
    """What the TP and CP collectives move per layer (plain numbers)."""

    num_layers: int
    hidden: int
    kv_width: int  # K/V width as SDPA sees it (GQA repeated to the query heads)


def tp_gpu_seconds_per_token(*, layer: LayerShape, tp: int, ac: str, gbytes: float) -> float:
    """GPU-seconds one token costs in TP collectives (all tp GPUs wait), latency left out: a lower bound."""
    return tp * tp_comm_seconds(tokens=1.0, layer=layer, tp=tp, ac=ac, gbytes=gbytes, latency=0.0)


def tp_comm_seconds(*, tokens: float, layer: LayerShape, tp: int, ac: str, gbytes: float, latency: float) -> float:
    """Per micro-batch: the TP(+SP) collectives of every layer, on the critical path.

    `tokens` is the micro-batch's tokens on this GPU's CP rank (micro_batch x seq / cp)."""
    if tp == 1:
        return 0.0
    mp = assumptions().raw["model_parallel"]
    calls = mp["tp_allreduces_forward_per_layer"] + mp["tp_allreduces_backward_per_layer"]
    if ac in ("selective", "full"):
        calls += mp["tp_allreduces_forward_per_layer"]  # recompute re-gathers the forward's inputs
    buf = tokens * layer.hidden * 2.0  # bf16 activations of the layer
    per_layer = calls * 2.0 * (tp - 1) / tp * buf / (gbytes * 1e9) + 2 * calls * latency
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


def layout_step_estimate(*, shape: Shape, tp: int, cp: int, layer: LayerShape, ac: str, peak_tflops: float,
                         intra_gbytes: float, inter_gbytes: float, params: int, trainable: int,
                         **kw: Any) -> StepEstimate:
    """step_estimate for a (tp, cp) layout: torchtitan's FSDP over dp x cp with TP inside the node.

    A TP group acts as one data-parallel rank with tp x the FLOPs and 1/tp of the parameters to
    gather and reduce (FSDP shards the TP shards); a CP rank sees seq/cp tokens per sample. FSDP's
    collectives then run over the dp x cp ranks, gpus_per_node / tp of them per node; TP's per-layer
    collectives (NVLink, exposed) and CP's ring (overlapped with compute) are added per micro-batch.
    """
    if tp * cp == 1:
        return step_estimate(shape=shape, peak_tflops=peak_tflops, intra_gbytes=intra_gbytes,
                             inter_gbytes=inter_gbytes, params=params, trainable=trainable, **kw)
    a = assumptions()
    fsdp_group = max(1, shape.shard_group // tp)
    virtual = Shape(nodes=shape.nodes, gpus_per_node=max(1, shape.gpus_per_node // tp), sharding=shape.sharding,
                    shard_group=fsdp_group, micro_batch=shape.micro_batch, grad_accum=shape.grad_accum,
                    seq_len=shape.seq_len // cp)
    base = step_estimate(shape=virtual, peak_tflops=peak_tflops * tp, intra_gbytes=intra_gbytes,
                         inter_gbytes=inter_gbytes, params=params // tp, trainable=trainable // tp, **kw)
    tokens = shape.micro_batch * shape.seq_len / cp
    tp_s = tp_comm_seconds(tokens=tokens, layer=layer, tp=tp, ac=ac, gbytes=intra_gbytes, latency=a.lat_intra)
    ring_intra = tp * cp <= shape.gpus_per_node
    cp_bw = intra_gbytes if ring_intra else min(intra_gbytes, inter_gbytes)
    cp_s = cp_comm_seconds(tokens=tokens, layer=layer, tp=tp, cp=cp, gbytes=cp_bw,
                           latency=a.lat_intra if ring_intra else a.lat_inter)
    compute_mb = base.terms["compute_per_micro_batch_s"]
    cp_exposed = max(0.0, cp_s - a.overlap * compute_mb)
    extra = (tp_s + cp_exposed) * shape.grad_accum
    step = base.step_time_s + extra
    tps = base.tokens_per_s * base.step_time_s / step
    exposed = base.exposed_comm_s + extra
    terms = dict(base.terms, tp_comm_per_micro_batch_s=tp_s, cp_ring_per_micro_batch_s=cp_s,
                 cp_exposed_per_micro_batch_s=cp_exposed)
    return StepEstimate(
        step_time_s=step, compute_time_s=base.compute_time_s, comm_time_s=base.comm_time_s + (tp_s + cp_s) * shape.grad_accum,
        exposed_comm_s=exposed, optimizer_time_s=base.optimizer_time_s, tokens_per_s=tps,
        mfu=base.mfu * base.step_time_s / step, utilisation=base.utilisation,
        comm_bytes_per_gpu=base.comm_bytes_per_gpu, bound="communication" if exposed > 0.25 * base.compute_time_s else "compute",
        terms=terms,
    )
