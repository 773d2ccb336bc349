"""gpuprov.sizing.idle_cache: the idle cache a compiled forward leaves at the loss, replayed through the allocator."""

from __future__ import annotations

from dataclasses import replace

from gpuprov.catalog.models import get_model
from gpuprov.sizing import idle_cache
from gpuprov.sizing.allocator import CachingAllocator
from gpuprov.sizing.idle_cache import BlockShape, compiled_forward_idle
from gpuprov.sizing import activations as act
from gpuprov.sizing.memory import constants, estimate_memory, working_set_floor
from gpuprov.sizing.types import TrainSetup

MiB, GiB = 2**20, 2**30
TOKENS = 16 * 8192
TP8 = BlockShape(tokens=TOKENS, hidden=8192, q=1024, kv=128, ffn=3584, tp=8, a=2, float8=True)


def _out(b: BlockShape) -> int:
    return b.tokens // b.tp * b.hidden * b.a


def test_a_forward_keeps_only_each_blocks_output() -> None:
    mha = BlockShape(tokens=8192, hidden=4096, q=4096, kv=4096, ffn=11008, tp=1, a=2, float8=False)  # no repeat_kv
    for shape in (TP8, mha):
        A = CachingAllocator()
        for _ in range(5):
            idle_cache._block_forward(A, shape)
        assert A.active == 5 * _out(shape)
        assert A.reserved > A.active  # the transients' segments stay cached


def test_a_logit_sized_request_strands_the_cache_and_one_that_fits_reuses_it() -> None:
    logits32 = TOKENS * 16032 * 4
    alone = compiled_forward_idle(TP8, 10, (logits32,), ())
    forward = CachingAllocator()
    forward.malloc(_out(TP8))
    for _ in range(10):
        idle_cache._block_forward(forward, TP8)
    assert alone == forward.idle > 0  # larger than every cached block: a new segment, the cache untouched
    fits = compiled_forward_idle(TP8, 10, (_out(TP8), logits32), ())
    assert fits == alone - _out(TP8)


def test_logits_freed_before_backward_stay_idle_when_nothing_later_fits_them() -> None:
    bf16, fp32 = TOKENS * 16032 * 2, TOKENS * 16032 * 4
    kept = compiled_forward_idle(TP8, 10, (bf16, fp32), ())
    freed = compiled_forward_idle(TP8, 10, (bf16, fp32), (0,))
    assert freed - kept == bf16


def test_the_estimate_floors_a_compiled_tp_rank_at_its_replayed_idle_cache() -> None:
    arch = get_model("llama-3.1-70b")
    s = TrainSetup(seq_len=8192, micro_batch=16, gpus=256, tp=8, sharding="fsdp", activation_checkpointing="full",
                   compile=True, float8=True, float8_all_gather=False, loss_impl="native")
    est = estimate_memory(arch, s)
    idle = idle_cache.compiled_stranded_at_loss(arch, s, 16 * 8192, 2, 8, arch.num_layers)
    assert idle > 4 * GiB
    assert est.breakdown["allocator_fragmentation"] == idle
    # eager blocks are not traced for torchtitan: the closed-form floor, sized on the whole sequence and width,
    # applies at the TP rank's share (1/8), unless the generic fraction of the live tensors is larger
    eager_s = replace(s, compile=False)
    eager = estimate_memory(arch, eager_s)
    tokens = 16 * 8192
    floor = working_set_floor(arch, eager_s, tokens, 2, act.activations(arch, eager_s, tokens, 2).final_norm)
    live = sum(v for k, v in eager.breakdown.items() if k not in ("allocator_fragmentation", "nccl_buffers",
                                                                  "cuda_context"))
    frac = constants()["allocator"]["fragmentation_eager"]
    assert eager.breakdown["allocator_fragmentation"] == max(int(live * frac), int(floor / 8))
