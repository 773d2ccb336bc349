#!/usr/bin/env python3
"""Replay the default stream's allocations of an eager full-AC Llama step through the CUDA caching allocator.

    python benchmarks/allocator_replay.py [--json]

How much memory the allocator holds idle at the start of backward depends on the order and sizes of what
the forward allocated and freed, so it is replayed, not guessed: the allocator's rules are
gpuprov/sizing/allocator.py, the trace gpuprov/sizing/idle_cache.py (the estimator uses both for this stack).

The allocation sequence is transformers v4.38.2 LlamaDecoderLayer / LlamaRMSNorm / LlamaSdpaAttention /
LlamaMLP under reentrant activation checkpointing (the forward runs without grad, so every intermediate is
freed as soon as Python drops it), peft 0.10.0 LoRA Linear.forward (bnb Linear4bit.forward: dequantized
weight, then the defensive clone) on fsdp_qlora's targets, then LlamaForCausalLM's legacy loss up to the
log-softmax gradient (the start of backward). Parameters, FSDP's gathered blocks and their streams are not
part of it: they live in other pools. It prints, per fsdp_qlora row shape, the live bytes and the idle cache
the replay leaves at that moment beside the closed-form floor and the estimate's allocator term.
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

from gpuprov.sizing import idle_cache  # noqa: E402 - the estimator's own replay

FSDP_QLORA_TARGETS = tuple(sorted(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")))

GIB = 2**30


@dataclass(frozen=True)
class Shape:
    name: str
    model: str
    batch: int
    seq: int
    qlora: bool
    dense_mask: bool = True  # transformers 4.38 Llama (Mistral: none)


def replay(arch, shape: Shape, rank: int = 64) -> tuple[int, int]:
    """(live, reserved) at the start of backward: the estimator's own trace (gpuprov.sizing.idle_cache)."""
    return idle_cache.hf_forward(idle_cache.HfShape(
        batch=shape.batch, seq=shape.seq, hidden=arch.hidden_size, q=arch.q_dim, kv=arch.kv_dim,
        ffn=arch.intermediate_size, layers=arch.num_layers, vocab=arch.vocab_size,
        mask_positions=int(arch.max_position_embeddings or shape.seq) if shape.dense_mask else 0, qlora=shape.qlora,
        rank=rank, adapted=FSDP_QLORA_TARGETS, dropout=True))


SHAPES = (
    Shape("7B LoRA bs10", "llama-2-7b", 10, 2048, False),
    Shape("7B LoRA bs6", "llama-2-7b", 6, 2048, False),
    Shape("7B QLoRA bs10", "llama-2-7b", 10, 2048, True),
    Shape("7B QLoRA bs12", "llama-2-7b", 12, 2048, True),
    Shape("Yi-34B QLoRA bs4", "yi-34b", 4, 2048, True),
    Shape("Mistral 7B QLoRA bs12", "mistral-7b", 12, 2048, True, dense_mask=False),
)


def _setup(shape: Shape):
    from gpuprov.sizing.types import TrainSetup

    return TrainSetup(task="qlora" if shape.qlora else "lora", lora_rank=64, lora_targets=FSDP_QLORA_TARGETS,
                      seq_len=shape.seq, micro_batch=shape.batch, gpus=2, gpus_per_node=2, fsdp_version=1,
                      activation_checkpointing="full", precision="bf16", loss_impl="hf-legacy", lora_dropout=0.1,
                      hf_llama_438=shape.dense_mask)


def analytic_term(arch, shape: Shape) -> int:
    from gpuprov.sizing.memory import estimate_memory

    return estimate_memory(arch, _setup(shape)).breakdown["allocator_fragmentation"]


def floor_term(arch, shape: Shape) -> int:
    from gpuprov.sizing import activations as act
    from gpuprov.sizing.memory import working_set_floor

    s = _setup(shape)
    tokens = shape.batch * shape.seq
    return working_set_floor(arch, s, tokens, 2, act.activations(arch, s, tokens, 2).final_norm)


def main(argv: list[str] | None = None) -> int:
    from gpuprov.catalog.models import get_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    rows = []
    for shape in SHAPES:
        arch = get_model(shape.model)
        live, reserved = replay(arch, shape)
        rows.append({"shape": shape.name, "live_gib": live / GIB, "reserved_gib": reserved / GIB,
                     "idle_gib": (reserved - live) / GIB, "floor_gib": floor_term(arch, shape) / GIB,
                     "estimate_allocator_gib": analytic_term(arch, shape) / GIB})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'shape':<24}{'live':>8}{'reserved':>10}{'idle':>8}{'floor':>8}{'estimate':>10}"
          "   (GiB, default stream at the start of backward)")
    for r in rows:
        print(f"{r['shape']:<24}{r['live_gib']:>8.2f}{r['reserved_gib']:>10.2f}{r['idle_gib']:>8.2f}"
              f"{r['floor_gib']:>8.2f}{r['estimate_allocator_gib']:>10.2f}")
    print("idle = cached blocks no request at that moment can use; floor = the closed form used where no trace"
          " applies (one block's forward working set + the freed bf16 logits); estimate = the estimator's"
          " allocator term for the row's stack (the replayed idle cache, or 10% of live if larger)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
