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

MiB = 2**20


def _index(seg: list[list], block: list) -> int:
    return next(i for i, b in enumerate(seg) if b is block)  # by identity: equal-sized blocks compare equal


class CachingAllocator:
    """One stream's large pool: segments of blocks [size, free, segment index].

    The free blocks are also kept by identity, so a request looks at them alone (a deep model's forward leaves a
    few free among hundreds held); among equal sizes the first in segment and block order wins, as a scan of
    every block in that order finds it (tests/test_idle_cache.py compares the two)."""

    def __init__(self) -> None:
        self.segments: list[list[list]] = []
        self._free: dict[int, list] = {}  # id(block) -> block, for every free block
        self.reserved = 0
        self.active = 0

    def _before(self, a: list, b: list) -> bool:
        """Whether free block `a` comes before `b` in segment and block order."""
        if a[2] != b[2]:
            return a[2] < b[2]
        seg = self.segments[a[2]]
        return _index(seg, a) < _index(seg, b)

    def malloc(self, size: int):
        size = (int(size) + 511) // 512 * 512
        if size <= MiB:
            return None  # small pool
        best = None
        for block in self._free.values():
            have = block[0]
            if have >= size and (best is None or have < best[0] or (have == best[0] and self._before(block, best))):
                best = block
        if best is None:
            rounded = (size + 2 * MiB - 1) // (2 * MiB) * (2 * MiB) if size >= 10 * MiB else 20 * MiB
            best = [rounded, True, len(self.segments)]
            self.segments.append([best])
            self.reserved += rounded
        else:
            del self._free[id(best)]
        if best[0] - size > MiB:
            seg = self.segments[best[2]]
            rest = [best[0] - size, True, best[2]]
            seg.insert(_index(seg, best) + 1, rest)
            self._free[id(rest)] = rest
            best[0] = size
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
            block[0] += seg[i + 1][0]
            del self._free[id(seg.pop(i + 1))]
        if i > 0 and seg[i - 1][1]:
            seg[i - 1][0] += seg.pop(i)[0]
        else:
            self._free[id(block)] = block

    @property
    def idle(self) -> int:
        return self.reserved - self.active
