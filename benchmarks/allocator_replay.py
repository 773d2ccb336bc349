#!/usr/bin/env python3
"""Replay the default stream's allocations of an eager full-AC Llama step through the CUDA caching allocator.

    python benchmarks/allocator_replay.py [--json]

How much memory the allocator holds idle at the start of backward depends on the order and sizes of what
the forward allocated and freed, so it is replayed, not guessed. The allocator's rules are those of
pytorch/pytorch@eb42ad6eca0ce61e7c581212b4bf32f991425571 c10/cuda/CUDACachingAllocator.cpp, large pool of
one stream: a request takes the smallest free block at least as large (get_free_block, lower_bound); the
block is split when more than 1 MiB would remain (should_split); a freed block merges only with its free
neighbours of the same segment (try_merge_blocks); with no block to take, a new segment of the request
rounded up to 2 MiB (20 MiB under 10 MiB) is reserved (get_allocation_size). Requests of 1 MiB or less go
to the small pool and are left out.

The allocation sequence is transformers v4.38.2 LlamaDecoderLayer / LlamaRMSNorm / LlamaSdpaAttention /
LlamaMLP under reentrant activation checkpointing (the forward runs without grad, so every intermediate is
freed as soon as Python drops it), peft 0.10.0 LoRA Linear.forward (bnb Linear4bit.forward: dequantized
weight, then the defensive clone) on fsdp_qlora's targets, then LlamaForCausalLM's legacy loss up to the
log-softmax gradient (the start of backward). Parameters, FSDP's gathered blocks and their streams are not
part of it: they live in other pools. It prints, per fsdp_qlora row shape, the live bytes and the idle cache
the replay leaves at that moment beside the analytic estimate's allocator term (gpuprov.sizing.memory).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MiB, GIB = 2**20, 2**30


def _index(seg: list[list], block: list) -> int:
    return next(i for i, b in enumerate(seg) if b is block)  # by identity: equal-sized blocks compare equal


class CachingAllocator:
    """One stream's large pool: segments of blocks [size, free]."""

    def __init__(self) -> None:
        self.segments: list[list[list]] = []
        self.reserved = 0
        self.active = 0

    def malloc(self, size: int):
        size = (size + 511) // 512 * 512
        if size <= MiB:
            return None  # small pool
        best = None
        for seg in self.segments:
            for block in seg:
                if block[1] and block[0] >= size and (best is None or block[0] < best[1][0]):
                    best = (seg, block)
        if best is None:
            rounded = (size + 2 * MiB - 1) // (2 * MiB) * (2 * MiB) if size >= 10 * MiB else 20 * MiB
            seg = [[rounded, True]]
            self.segments.append(seg)
            self.reserved += rounded
            best = (seg, seg[0])
        seg, block = best
        if block[0] - size > MiB:
            seg.insert(_index(seg, block) + 1, [block[0] - size, True])
            block[0] = size
        block[1] = False
        self.active += block[0]
        return (seg, block)

    def free(self, handle) -> None:
        if handle is None:
            return
        seg, block = handle
        block[1] = True
        self.active -= block[0]
        i = _index(seg, block)
        if i + 1 < len(seg) and seg[i + 1][1]:
            block[0] += seg.pop(i + 1)[0]
        if i > 0 and seg[i - 1][1]:
            seg[i - 1][0] += seg.pop(i)[0]

    @property
    def idle(self) -> int:
        return self.reserved - self.active


@dataclass(frozen=True)
class Shape:
    name: str
    model: str
    batch: int
    seq: int
    qlora: bool
    dense_mask: bool = True  # transformers 4.38 Llama (Mistral: none)


def replay(arch, shape: Shape, rank: int = 64) -> CachingAllocator:
    """The forward of every block, the final norm and the loss up to the log-softmax gradient."""
    A, T = CachingAllocator(), shape.batch * shape.seq
    h, f = arch.hidden_size, arch.intermediate_size
    q_w, kv_w = arch.q_dim, arch.kv_dim
    H, F = T * h * 2, T * f * 2
    positions = arch.max_position_embeddings or shape.seq

    def norm():  # LlamaRMSNorm: .to(fp32), pow, x * rsqrt, .to(bf16), weight *
        a, p = A.malloc(2 * H), A.malloc(2 * H)
        A.free(p)
        b = A.malloc(2 * H)
        A.free(a)
        c = A.malloc(H)
        A.free(b)
        n = A.malloc(H)
        A.free(c)
        return n

    def linear(n_in: int, n_out: int, lora: bool):
        out = T * n_out * 2
        if shape.qlora:  # bnb MatMul4Bit: dequantized weight, output, then peft's clone
            w = A.malloc(n_in * n_out * 2)
            base = A.malloc(out)
            A.free(w)
            clone = A.malloc(out)
            A.free(base)
            base = clone
        else:
            base = A.malloc(out)
        if not lora:
            return base
        drop, mask = A.malloc(T * n_in * 2), A.malloc(T * n_in)  # dropout output and its bool mask
        A.free(mask)
        a_out = A.malloc(T * rank * 2)
        A.free(drop)
        b_out = A.malloc(out)
        A.free(a_out)
        scaled = A.malloc(out)
        A.free(b_out)
        total = A.malloc(out)
        A.free(base)
        A.free(scaled)
        return total

    def rope(t, width: int):
        t1, t2 = A.malloc(width), A.malloc(width // 2)
        t3 = A.malloc(width)
        A.free(t2)
        t4 = A.malloc(width)
        A.free(t3)
        e = A.malloc(width)
        A.free(t1)
        A.free(t4)
        A.free(t)
        return e

    if shape.dense_mask:  # _update_causal_mask: repeat (bool), .to(dtype), * min_dtype
        b = A.malloc(shape.batch * positions * positions)
        bf = A.malloc(2 * shape.batch * positions * positions)
        A.free(b)
        A.malloc(2 * shape.batch * positions * positions)
        A.free(bf)
    saved = [A.malloc(H)]  # embeddings
    for _ in range(arch.num_layers):
        n = norm()
        q = linear(h, q_w, True)
        k = linear(h, kv_w, True)
        v = linear(h, kv_w, True)
        qe = rope(q, T * q_w * 2)
        ke = rope(k, T * kv_w * 2)
        mask_slice = A.malloc(2 * shape.batch * shape.seq * shape.seq) if shape.dense_mask else None
        rep = q_w // kv_w  # repeat_kv copies under GQA, .contiguous() copies otherwise
        qc = A.malloc(T * q_w * 2)
        A.free(qe)
        kc, vc = A.malloc(T * kv_w * 2 * rep), A.malloc(T * kv_w * 2 * rep)
        A.free(ke)
        A.free(v)
        o = A.malloc(T * q_w * 2)
        for t in (qc, kc, vc, mask_slice):
            A.free(t)
        oc = A.malloc(T * q_w * 2)
        A.free(o)
        op = linear(q_w, h, False)
        A.free(oc)
        A.free(n)
        r1 = A.malloc(H)
        A.free(op)
        n2 = norm()
        g = linear(h, f, True)
        act = A.malloc(F)
        A.free(g)
        u = linear(h, f, True)
        prod = A.malloc(F)
        A.free(act)
        A.free(u)
        dn = linear(f, h, True)
        A.free(prod)
        A.free(n2)
        saved.append(A.malloc(H))
        A.free(dn)
        A.free(r1)
    last = saved.pop()
    _kept, p = A.malloc(2 * H), A.malloc(2 * H)  # final norm: keeps its fp32 input
    A.free(p)
    b = A.malloc(2 * H)
    c = A.malloc(H)
    A.free(b)
    normed = A.malloc(H)
    A.free(c)
    A.free(last)
    logits = T * arch.vocab_size * 2
    bf16 = A.malloc(logits)
    A.malloc(2 * logits)  # logits.float(), kept by the output
    A.free(bf16)
    shifted = A.malloc(2 * logits)
    A.malloc(2 * logits)  # log_softmax
    A.free(shifted)
    A.free(normed)
    A.malloc(2 * logits)  # nll_loss gradient
    A.malloc(2 * logits)  # log_softmax gradient: the peak
    return A


SHAPES = (
    Shape("7B LoRA bs10", "llama-2-7b", 10, 2048, False),
    Shape("7B LoRA bs6", "llama-2-7b", 6, 2048, False),
    Shape("7B QLoRA bs10", "llama-2-7b", 10, 2048, True),
    Shape("7B QLoRA bs12", "llama-2-7b", 12, 2048, True),
    Shape("Yi-34B QLoRA bs4", "yi-34b", 4, 2048, True),
    Shape("Mistral 7B QLoRA bs12", "mistral-7b", 12, 2048, True, dense_mask=False),
)


def analytic_term(arch, shape: Shape) -> int:
    from gpuprov.sizing.memory import estimate_memory
    from gpuprov.sizing.types import TrainSetup

    s = TrainSetup(task="qlora" if shape.qlora else "lora", lora_rank=64,
                   lora_targets=("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"),
                   seq_len=shape.seq, micro_batch=shape.batch, gpus=2, gpus_per_node=2, fsdp_version=1,
                   activation_checkpointing="full", precision="bf16", loss_impl="hf-legacy", lora_dropout=0.1,
                   hf_llama_438=shape.dense_mask)
    return estimate_memory(arch, s).breakdown["allocator_fragmentation"]


def main(argv: list[str] | None = None) -> int:
    from gpuprov.catalog.models import get_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    rows = []
    for shape in SHAPES:
        arch = get_model(shape.model)
        a = replay(arch, shape)
        rows.append({"shape": shape.name, "live_gib": a.active / GIB, "reserved_gib": a.reserved / GIB,
                     "idle_gib": a.idle / GIB, "estimate_allocator_gib": analytic_term(arch, shape) / GIB})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'shape':<24}{'live':>8}{'reserved':>10}{'idle':>8}{'estimate':>10}   (GiB, default stream at the start of backward)")
    for r in rows:
        print(f"{r['shape']:<24}{r['live_gib']:>8.2f}{r['reserved_gib']:>10.2f}{r['idle_gib']:>8.2f}"
              f"{r['estimate_allocator_gib']:>10.2f}")
    print("idle = cached blocks no request at that moment can use; estimate = the analytic allocator term "
          "(its floor: one block's forward working set + the freed bf16 logits, or 10% of live)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
