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
    """One stream's large pool: segments of blocks [size, free]."""

    def __init__(self) -> None:
        self.segments: list[list[list]] = []
        self.reserved = 0
        self.active = 0

    def malloc(self, size: int):
        size = (int(size) + 511) // 512 * 512
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
