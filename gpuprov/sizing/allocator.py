"""The CUDA caching allocator's large pool, replayed: reserved memory is not live memory.

What the allocator keeps cached depends on the order and sizes of what was allocated and freed, so it is replayed,
not guessed (idle_cache.py feeds it the allocation order of a training step's forward). The rules are those of
pytorch/pytorch@eb42ad6eca0ce61e7c581212b4bf32f991425571 c10/cuda/CUDACachingAllocator.cpp for one stream's
large pool: a request takes the smallest free block at least as large (get_free_block, lower_bound); the block is
split when more than 1 MiB would remain (should_split); a freed block merges only with its free neighbours of the
same segment (try_merge_blocks); with no block to take, a new segment of the request rounded up to 2 MiB (20 MiB
under 10 MiB) is reserved (get_allocation_size). Requests of 1 MiB or less go to the small pool and are left out.
"""

from __future__ import annotations

from bisect import bisect_left, insort

MiB = 2**20


def _index(seg: list[list], block: list) -> int:
    for i, b in enumerate(seg):
        if b is block:  # by identity: equal-sized blocks compare equal
            return i
    raise ValueError("block not in its segment")


class CachingAllocator:
    """One stream's large pool: segments of blocks [size, free, segment index, offset in the segment].

    The free blocks are also kept as (size, segment index, offset, block) in ascending order, so a request finds
    its best fit by bisection instead of looking at every block: the smallest at least as large and, among equal
    sizes, the first in segment and block order, as a scan of every block in that order finds it
    (tests/test_idle_cache.py compares the two). A block's offset orders it within its segment: a split puts the
    rest at the block's end, a merge keeps the first piece's offset."""

    def __init__(self) -> None:
        self.segments: list[list[list]] = []
        self._free: list[tuple] = []  # (size, segment, offset, block) of every free block, ascending
        self.reserved = 0
        self.active = 0

    def _add_free(self, block: list) -> None:
        insort(self._free, (block[0], block[2], block[3], block))

    def _drop_free(self, block: list) -> None:
        free = self._free
        del free[bisect_left(free, (block[0], block[2], block[3]))]

    def malloc(self, size: int):
        size = (int(size) + 511) // 512 * 512
        if size <= MiB:
            return None  # small pool
        free = self._free
        i = bisect_left(free, (size,))
        if i == len(free):
            rounded = (size + 2 * MiB - 1) // (2 * MiB) * (2 * MiB) if size >= 10 * MiB else 20 * MiB
            best = [rounded, True, len(self.segments), 0]
            self.segments.append([best])
            self.reserved += rounded
        else:
            best = free.pop(i)[3]
        if best[0] - size > MiB:
            seg = self.segments[best[2]]
            rest = [best[0] - size, True, best[2], best[3] + size]
            seg.insert(_index(seg, best) + 1, rest)
            best[0] = size
            self._add_free(rest)
        best[1] = False
        self.active += best[0]
        return best

    def free(self, block) -> None:
        if block is None:
            return
        seg = self.segments[block[2]]
        block[1] = True
        self.active -= block[0]
        i = _index(seg, block)
        if i + 1 < len(seg) and seg[i + 1][1]:
            self._drop_free(seg[i + 1])
            block[0] += seg.pop(i + 1)[0]
        if i > 0 and seg[i - 1][1]:
            prev = seg[i - 1]
            self._drop_free(prev)
            prev[0] += seg.pop(i)[0]
            self._add_free(prev)
        else:
            self._add_free(block)

    @property
    def idle(self) -> int:
        return self.reserved - self.active
