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

from bisect import bisect_left

MiB = 2**20


def _index(seg: list[list], block: list) -> int:
    for i, b in enumerate(seg):
        if b is block:  # by identity: equal-sized blocks compare equal
            return i
    raise ValueError("block not in its segment")


class CachingAllocator:
    """One stream's large pool: segments of blocks [size, free, segment index].

    The free blocks are also kept sorted by size (and, among equal sizes, in segment and block order), so a
    request finds its best fit by bisection instead of looking at every block; the first in that order wins, as
    a scan of every block in segment and block order finds it (tests/test_idle_cache.py compares the two). That
    order between two blocks never changes: a split puts the rest right after its block, a merge removes one."""

    def __init__(self) -> None:
        self.segments: list[list[list]] = []
        self._sizes: list[int] = []  # the free blocks' sizes, ascending
        self._free: list[list] = []  # the free blocks, in the order of _sizes
        self.reserved = 0
        self.active = 0

    def _before(self, a: list, b: list) -> bool:
        """Whether block `a` comes before `b` in segment and block order."""
        if a[2] != b[2]:
            return a[2] < b[2]
        seg = self.segments[a[2]]
        return _index(seg, a) < _index(seg, b)

    def _add_free(self, block: list) -> None:
        sizes, size = self._sizes, block[0]
        i = bisect_left(sizes, size)
        end, where = len(sizes), block[2]
        while i < end and sizes[i] == size:  # after the equal-sized blocks that come before it
            other = self._free[i]
            if other[2] > where or (other[2] == where and not self._before(other, block)):
                break
            i += 1
        sizes.insert(i, size)
        self._free.insert(i, block)

    def _drop_free(self, block: list) -> None:
        i = bisect_left(self._sizes, block[0])
        while self._free[i] is not block:
            i += 1
        del self._sizes[i], self._free[i]

    def malloc(self, size: int):
        size = (int(size) + 511) // 512 * 512
        if size <= MiB:
            return None  # small pool
        i = bisect_left(self._sizes, size)
        if i == len(self._sizes):
            rounded = (size + 2 * MiB - 1) // (2 * MiB) * (2 * MiB) if size >= 10 * MiB else 20 * MiB
            best = [rounded, True, len(self.segments)]
            self.segments.append([best])
            self.reserved += rounded
        else:
            best = self._free[i]
            del self._sizes[i], self._free[i]
        if best[0] - size > MiB:
            seg = self.segments[best[2]]
            rest = [best[0] - size, True, best[2]]
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
