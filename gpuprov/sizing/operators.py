"""Compute time of one micro-batch on one GPU, operation by operation.

    GEMMs        every linear's forward, input-gradient and weight-gradient matmul at its (M, N, K):
                 FLOPs / (peak x isolated-GEMM ceiling x in-training fraction x wave efficiency), or its
                 bytes / HBM bandwidth where the GEMM is too skinny to be compute-bound (roofline)
    attention    FlashAttention-2 forward + backward FLOPs (causal: half) at its published TFLOP/s for
                 the sequence length
    memory-bound norms, RoPE, SwiGLU, residual adds, the loss and FSDP's copy-in/out: bytes / HBM
    launch       kernels per layer x what each kernel costs beyond its work (compile fuses most away), and the
                 time the GPU waits for the host to issue them when the kernels are shorter than their launches

Activation checkpointing adds the recomputed forward operations; float8 divides the blocks' GEMMs by
the linears' own speed-up; tensor parallelism splits N (column-wise) or K (row-wise) of each linear and
the heads; context parallelism splits the tokens and the attention work; a pipeline stage runs its
share of the layers. Plain numbers only (the planner evaluates it many times); constants in
catalog/data/operators.yaml, each with its source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from gpuprov.catalog import load_data

# which block matmuls split their output (column-wise) under TP; the others split their input (row-wise)
_COLWISE = (True, True, True, False, True, True, False)  # q, k, v, o, gate, up, down


@lru_cache(maxsize=1)
def constants() -> dict[str, Any]:
    return load_data("operators.yaml")


@dataclass(frozen=True)
class OpShape:
    """What the operations of one model are made of (plain numbers from the architecture)."""

    layers: int
    hidden: int
    qkv: int  # q_dim + kv_dim (RoPE runs on q and k)
    inter: int  # the MLP's active width per token (experts_per_token x intermediate for MoE)
    heads: int
    head_dim: int
    vocab: int
    matmuls: tuple[tuple[int, int], ...]  # the block's linears (in, out) in forward order
    sac_recomputed: tuple[bool, ...]  # op-level SAC recomputes the even-numbered matmuls
    sliding_window: int = 0
    sliding_layers: int = 0


def op_shape(arch: Any) -> OpShape:
    from gpuprov.sizing.throughput import _block_matmuls

    mm = tuple(_block_matmuls(arch))
    inter = arch.intermediate_size * (arch.experts_per_token if getattr(arch, "is_moe", False) else 1)
    return OpShape(layers=arch.num_layers, hidden=arch.hidden_size, qkv=arch.q_dim + arch.kv_dim, inter=inter,
                   heads=arch.num_attention_heads, head_dim=arch.attn_head_dim, vocab=arch.vocab_size, matmuls=mm,
                   sac_recomputed=tuple(n % 2 == 0 for n in range(1, len(mm) + 1)),
                   sliding_window=int(arch.sliding_window or 0), sliding_layers=int(arch.sliding_layers or 0))


@dataclass(frozen=True)
class GpuOps:
    """What one GPU (at its power limit) does per second for each kind of operation."""

    gemm_flops: float  # achieved bf16 FLOP/s of a large GEMM in training
    sms: int
    hbm_bytes: float  # bytes/s
    attn_curve: tuple[tuple[float, float], ...]  # (log2 seq, FLOP/s) the SDPA kernel's fwd+bwd, causal
    kernel_s: float


def _clock(gpu: Any, cls: str, measured_at: dict[str, Any]) -> float:
    from gpuprov.sizing.throughput import assumptions

    at = measured_at.get(cls)
    tdp = getattr(gpu, "tdp_w", None)
    if not at or not tdp or tdp >= at:
        return 1.0
    return float((float(tdp) / float(at)) ** float(assumptions().raw["power"]["clock_exponent"]))


def gpu_ops(gpu: Any, gemm_scale: float = 1.0, sdpa_backend: str | None = None) -> GpuOps:
    """The GPU's operation rates; `gemm_scale` multiplies the achieved GEMM throughput (a calibration);
    `sdpa_backend` (flash | cudnn; None: what gpuprov's trainer runs) picks the attention kernel's curve."""
    from gpuprov.sizing.throughput import gpu_class

    c, cls = constants(), gpu_class(gpu)
    g, at = c["gemm"], c["attention"]
    ceiling = float(g["ceiling"].get(cls, g["ceiling"]["hopper"]))
    gemm = gpu.bf16_tflops * 1e12 * ceiling * float(g["in_training"]) * _clock(gpu, cls, g["ceiling_measured_at_w"])
    curve = attention_curve(cls, sdpa_backend or at["trainer_backend"])
    if curve is None:  # no published curve: the reference class's, scaled by the dense peak
        ref = at["scale_from"]
        scale = gpu.bf16_tflops / 989.4 if ref == "hopper" else 1.0
        curve = at["fwd_bwd_causal_tflops"][ref]
    else:
        scale = _clock(gpu, cls, at["measured_at_w"])
    return GpuOps(gemm_flops=gemm * gemm_scale, sms=int(g["sm_count"].get(gpu.slug, g["sm_count_default"])),
                  hbm_bytes=gpu.hbm_gbytes_per_s * 1e9,
                  attn_curve=tuple((math.log2(s), t * 1e12 * scale) for s, t in curve),
                  kernel_s=float(c["launch"]["seconds_per_kernel"]))


def attention_curve(cls: str, backend: str) -> list[tuple[float, float]] | None:
    """[(seq, fwd + bwd TFLOP/s)] of `backend`'s kernel measured on this GPU class, or None where only the
    flash kernel's reference class was measured. The forward and backward are combined as FlashAttention counts
    the work: 1 unit at the forward's rate, 2.5 at the backward's."""
    at = constants()["attention"]
    measured = at["fwd_bwd_by_backend"].get(backend)
    if measured is None:
        raise ValueError(f"unknown SDPA backend {backend!r} (one of: {', '.join(at['fwd_bwd_by_backend'])})")
    if cls in measured:
        return [(float(s), 3.5 / (1.0 / f + 2.5 / b)) for s, f, b in measured[cls]]
    if backend == "flash":
        curve = at["fwd_bwd_causal_tflops"].get(cls)
        return [(float(s), float(t)) for s, t in curve] if curve else None
    raise ValueError(f"no published {backend} attention measurement for {cls} GPUs")


def gemm_seconds(m: float, n: float, k: float, g: GpuOps) -> float:
    """One bf16 GEMM (M x K) @ (K x N): compute at the wave-quantised throughput or HBM traffic, the slower."""
    tm, tn = constants()["gemm"]["tile"]
    tiles = math.ceil(m / tm) * math.ceil(n / tn)
    waves = math.ceil(tiles / g.sms)
    wave_eff = tiles / (waves * g.sms)
    flops = 2.0 * m * n * k
    moved = 2.0 * (m * k + k * n + m * n)
    return max(flops / (g.gemm_flops * wave_eff), moved / g.hbm_bytes)


def attention_flops_per_s(seq: float, g: GpuOps) -> float:
    """The SDPA kernel's published fwd+bwd throughput at this sequence length (log-linear, clamped)."""
    pts, x = g.attn_curve, math.log2(max(1.0, seq))
    if x <= pts[0][0]:
        return pts[0][1] * max(0.05, seq / 2 ** pts[0][0])  # shorter: the launch grid is not full
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


@dataclass(frozen=True)
class Layout:
    """What one GPU runs of a micro-batch (plain numbers)."""

    micro_batch: int
    seq_len: int  # the full sequence
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ac: str = "selective"
    task: str = "full"
    compiled: bool = True
    float8_gain: float = 1.0
    fsdp_params: float = 0.0  # parameters this rank unshards per micro-batch (0: no FSDP copy-in/out)
    trainable: float = 0.0  # LoRA adapters (their GEMMs counted at FLOPs / the GEMM rate)
    qlora_factor: float = 1.0
    gemm_chunks: int = 1  # async TP: each forward and input-gradient GEMM runs as this many row chunks
    repeats: int = 1  # pipeline micro-batches of `micro_batch` samples in one pass (FSDP copies once per pass)
    every_tile: bool = False  # the attention kernel computes every score tile (a dense mask: no causal skipping)
    # CP with per-document attention: keys and values all-gathered, masked SDPA over the whole window inside its own
    # checkpoint (OpModel.cp_gather), so backward runs the attention forward once more
    cp_gather: bool = False


def _block_gemm_seconds(s: OpShape, lay: Layout, g: GpuOps, tokens: float) -> tuple[float, float]:
    """(forward + backward GEMM seconds of one block, the forward GEMMs AC runs again)."""
    fwd = bwd = again = 0.0
    wgrad = lay.task == "full"  # LoRA/QLoRA: frozen base weights take no weight gradient
    # async TP (torch/distributed/_symmetric_memory/__init__.py fused_all_gather_matmul and
    # fused_matmul_reduce_scatter: _pipelined_all_gather_and_consume / _pipelined_produce_and_all2all) runs one
    # matmul per rank's shard of the tokens so each overlaps the next shard's transfer: tp GEMMs of M / tp rows
    chunks = max(1, lay.gemm_chunks)
    rows = tokens / chunks
    for (k, n), col, sac in zip(s.matmuls, _COLWISE, s.sac_recomputed):
        k_, n_ = (k, n / lay.tp) if col else (k / lay.tp, n)
        f = chunks * gemm_seconds(rows, n_, k_, g)
        fwd += f
        bwd += chunks * gemm_seconds(rows, k_, n_, g) + (gemm_seconds(k_, n_, tokens, g) if wgrad else 0.0)
        if lay.ac == "full" or (lay.ac == "selective" and sac):
            again += f
    return fwd + bwd, again


def _attention_seconds(s: OpShape, lay: Layout, g: GpuOps, mb: int) -> float:
    """Forward + backward FlashAttention-2 of every layer on this rank (causal: half the square; CP splits
    the work evenly with its load balancing; TP splits the heads); sliding-window layers see the window.
    With `every_tile` (SDPA given a dense per-document mask runs the memory-efficient kernel, which adds the
    mask as a bias to every score tile and skips none: pytorch aten/src/ATen/native/transformers/cuda/
    mem_eff_attention/kernel_forward.h) the whole square is computed, timed at the same measured rate."""
    total = 0.0
    seq = lay.seq_len
    for sliding, count in ((True, s.sliding_layers), (False, s.layers - s.sliding_layers)):
        if count <= 0:
            continue
        kv = min(seq, s.sliding_window) if sliding and s.sliding_window else seq
        # forward 4 s kv d per head causal-halved (full square when the window is shorter), backward 2.5x
        pairs = seq * kv / 2.0 if kv == seq and not lay.every_tile else seq * kv
        flops = 3.5 * 4.0 * pairs * s.head_dim * s.heads / lay.tp / lay.cp * mb
        total += count * flops / attention_flops_per_s(seq / lay.cp, g)
    return total


def attention_forwards_again(ac: str, cp_gather: bool) -> int:
    """How many more times backward runs each layer's attention forward. Full AC runs the block's forward again.
    Under CP with documents the trainer's cp_attention wraps its gathers and SDPA in a non-reentrant checkpoint,
    which recomputes once more on its own. Nested inside full AC's checkpoint the forward then runs three times in
    all. Selective AC saves the SDPA output (train_model.selective_ac_context), so its recompute reads it back and
    only the inner checkpoint computes again. Counted with aten dispatch on torch 2.13:
    tests/test_cp_attention_counts.py."""
    return int(ac == "full") + int(cp_gather)


def cp_gather_passes(ac: str) -> int:
    """All-gathers of each layer's keys and values per micro-batch under CP with documents (train_attention
    _GatherSeq; its backward is one reduce-scatter more). The forward gathers, the inner checkpoint's recompute
    gathers again, and any block-level AC recompute (full or selective: collectives are not saved) gathers a third
    time."""
    return 2 + int(ac in ("full", "selective"))


def compute_terms(s: OpShape, lay: Layout, g: GpuOps) -> dict[str, float]:
    """Seconds of one micro-batch on one GPU by kind of operation: gemm, attention, memory_bound, launch."""
    c = constants()
    mode = "compiled" if lay.compiled else "eager"
    tokens = lay.micro_batch * lay.seq_len / lay.cp
    layers = -(-s.layers // lay.pp)
    frac = layers / s.layers
    block, again = _block_gemm_seconds(s, lay, g, tokens)
    gemm = layers * (block + again) / lay.float8_gain
    # the output head on the last stage (the pipeline's pace is its slowest stage): vocab split by TP
    head = 3 * gemm_seconds(tokens, s.vocab / lay.tp, s.hidden, g) / lay.pp
    gemm = (gemm + head + 6.0 * lay.trainable / lay.tp / lay.pp * tokens / g.gemm_flops) / lay.qlora_factor
    attn = _attention_seconds(s, lay, g, lay.micro_batch) * frac
    attn *= 1.0 + attention_forwards_again(lay.ac, lay.cp_gather) / 3.5  # each forward again is 1 of 3.5
    mem = c["memory_bound"]
    w = mem[mode]
    fwd_bytes = (w["h"] * s.hidden + w["qkv"] * s.qkv + w["i"] * s.inter) / lay.tp
    passes = 1.0 + float(mem["backward_factor"]) + (1.0 if lay.ac in ("selective", "full") else 0.0)
    moved = layers * tokens * fwd_bytes * passes
    moved += tokens * s.vocab / lay.tp * float(mem["loss_bytes_per_vocab"][mode]) / lay.pp
    kernels = layers * float(c["launch"]["kernels_per_layer"][mode])
    r = lay.repeats
    memory_bound = (moved * r + lay.fsdp_params * float(mem["fsdp_copy_bytes_per_param"])) / g.hbm_bytes
    launch = kernels * g.kernel_s * r
    # the GPU waits for the host where issuing the kernels takes longer than running them
    host = kernels * r * float(c["launch"]["host_seconds_per_kernel"])
    launch += max(0.0, host - (gemm * r + attn * r + memory_bound + launch))
    return {"gemm_s": gemm * r, "attention_s": attn * r, "memory_bound_s": memory_bound, "launch_s": launch}


@dataclass(frozen=True)
class OpModel:
    """One model on one GPU with the stack's settings: what step_estimate times compute with."""

    shape: OpShape
    gpu: GpuOps
    ac: str
    compiled: bool = True
    task: str = "full"
    adapters: float = 0.0  # LoRA/QLoRA trainable parameters
    qlora_factor: float = 1.0
    every_tile: bool = False  # attention under a dense per-document mask (Layout.every_tile)
    # packed documents attended per document: under CP (cp > 1) the trainer all-gathers keys and values over the CP
    # group and runs masked SDPA on the whole window (templates/launch/train_attention.py cp_attention), whatever
    # the model's attention implementation, instead of ring attention
    cp_gather: bool = False

    def terms(self, *, micro_batch: int, seq_len: int, tp: int = 1, cp: int = 1, pp: int = 1,
              float8_gain: float = 1.0, fsdp_params: float = 0.0, peak_fraction: float = 1.0,
              gemm_chunks: int = 1, repeats: int = 1) -> dict[str, float]:
        """Seconds by kind for `micro_batch` samples, run as `repeats` pipeline micro-batches of equal size."""
        repeats = max(1, min(repeats, micro_batch))
        lay = Layout(micro_batch=micro_batch // repeats, seq_len=seq_len, repeats=repeats, tp=tp, cp=cp, pp=pp, ac=self.ac, task=self.task,
                     gemm_chunks=gemm_chunks,
                     compiled=self.compiled, float8_gain=float8_gain, fsdp_params=fsdp_params,
                     trainable=self.adapters if self.task != "full" else 0.0, qlora_factor=self.qlora_factor,
                     every_tile=self.every_tile or self.gathers(cp), cp_gather=self.gathers(cp))
        out = compute_terms(self.shape, lay, self.gpu)
        if peak_fraction != 1.0:  # fp32 matmuls run on TF32 tensor cores
            out["gemm_s"] /= peak_fraction
        return out

    def gathers(self, cp: int) -> bool:
        """Whether a layout of this CP degree runs the trainer's all-gather attention (not ring attention)."""
        return self.cp_gather and cp > 1

    def attention_work_factor(self, seq_len: int, cp: int = 1) -> float:
        """Attention FLOPs the kernel executes over the causal count (1: causal skipping). Under a dense mask every
        layer that sees the whole sequence computes the square, twice the causal half; sliding-window layers
        computed their whole window already."""
        if not (self.every_tile or self.gathers(cp)) or not self.shape.layers:
            return 1.0
        s = self.shape
        windowed = s.sliding_layers if s.sliding_window and s.sliding_window < seq_len else 0
        return 1.0 + (s.layers - windowed) / s.layers


def op_model(arch: Any, gpu: Any, *, ac: str, compiled: bool = True, task: str = "full", trainable: float = 0.0,
             gemm_scale: float = 1.0, document_mask: bool = False, cp_gather: bool = False,
             sdpa_backend: str | None = None) -> OpModel:
    """`document_mask`: the attention gets a dense per-document mask (TrainSetup.document_mask: SDPA on packed
    data), so its kernel computes every score tile. `cp_gather`: under CP the trainer gathers keys and values
    (OpModel.cp_gather), as gpuprov's trainer does on packed data; published ring-attention runs have not.
    `sdpa_backend`: the attention kernel a run's code picks (gpu_ops)."""
    from gpuprov.sizing.throughput import assumptions

    return OpModel(shape=op_shape(arch), gpu=gpu_ops(gpu, gemm_scale, sdpa_backend), ac=ac, compiled=compiled,
                   task=task, adapters=float(trainable),
                   qlora_factor=assumptions().qlora_factor if task == "qlora" else 1.0,
                   every_tile=document_mask, cp_gather=cp_gather)


def min_gemm_seconds_per_flop(gpu: Any, gemm_scale: float = 1.0) -> float:
    """A lower bound on any GEMM's seconds per FLOP on this GPU (no wave or bandwidth loss): the planner's bound."""
    return 1.0 / gpu_ops(gpu, gemm_scale).gemm_flops
