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


class _ScanEveryBlock:
    """The allocator's rules as first written (allocator.py's docstring): every block scanned on every request."""

    def __init__(self) -> None:
        self.segments: list[list[list]] = []
        self.reserved = self.active = 0

    def malloc(self, size: int):
        size = (int(size) + 511) // 512 * 512
        if size <= 2**20:
            return None
        best = None
        for seg in self.segments:
            for block in seg:
                if block[1] and block[0] >= size and (best is None or block[0] < best[1][0]):
                    best = (seg, block)
        if best is None:
            rounded = (size + 2 * 2**20 - 1) // (2 * 2**20) * (2 * 2**20) if size >= 10 * 2**20 else 20 * 2**20
            seg = [[rounded, True]]
            self.segments.append(seg)
            self.reserved += rounded
            best = (seg, seg[0])
        seg, block = best
        if block[0] - size > 2**20:
            seg.insert(_position(seg, block) + 1, [block[0] - size, True])
            block[0] = size
        block[1] = False
        self.active += block[0]
        return best

    def free(self, handle) -> None:
        if handle is None:
            return
        seg, block = handle
        block[1] = True
        self.active -= block[0]
        i = _position(seg, block)
        if i + 1 < len(seg) and seg[i + 1][1]:
            block[0] += seg.pop(i + 1)[0]
        if i > 0 and seg[i - 1][1]:
            seg[i - 1][0] += seg.pop(i)[0]


def _position(items: list, item: object) -> int:
    return next(i for i, x in enumerate(items) if x is item)


def test_the_allocator_takes_the_block_a_scan_of_every_block_takes() -> None:
    """Looking at the free blocks alone changes no choice: random mixes of requests (many of equal size, where the
    first in segment and block order must win) and frees leave the same segments, block for block, and hand out
    the same blocks."""
    import random

    MiB = 2**20
    for seed in range(40):
        rng = random.Random(seed)
        fast, ref = CachingAllocator(), _ScanEveryBlock()
        live: list[tuple] = []
        sizes = [rng.choice([1, 3, 4, 8, 12, 24, 64]) * MiB + rng.choice([0, 0, 512, 7777]) for _ in range(6)]
        for _ in range(400):
            if live and rng.random() < 0.45:
                a, b = live.pop(rng.randrange(len(live)))
                fast.free(a)
                ref.free(b)
            else:
                size = rng.choice(sizes) if rng.random() < 0.7 else rng.randrange(1, 80 * MiB)
                live.append((fast.malloc(size), ref.malloc(size)))
            assert [[b[:2] for b in seg] for seg in fast.segments] == ref.segments
            assert (fast.reserved, fast.active) == (ref.reserved, ref.active)
        for a, b in live:
            assert (a is None) == (b is None)
            if a is not None:
                seg = fast.segments[a[2]]
                assert _position(ref.segments, b[0]) == a[2] and _position(seg, a) == _position(b[0], b[1])
