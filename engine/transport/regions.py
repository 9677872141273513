"""Offset allocator for a producer's pool buffer.

Written by hand because nothing in the standard library or our dependencies hands out offsets
within one fixed buffer: a first-fit free list, sorted by offset and coalesced on free. Pools
hold at most a few hundred live regions, so linear first-fit is cheap and keeps fragmentation
low. Not thread-safe: the pool calls it under its lock.
"""

from __future__ import annotations

import bisect


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


class RegionAllocator:
    def __init__(self, capacity: int, align: int):
        if capacity <= 0 or align <= 0:
            raise ValueError("capacity and align must be positive")
        self.capacity = capacity - capacity % align
        self.align = align
        self.used = 0
        self.peak = 0
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []

    def allocate(self, size: int) -> tuple[int, int] | None:
        """(offset, reserved size) of a free region of at least ``size`` bytes, or None if full."""
        size = round_up(max(size, 1), self.align)
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                self.used += size
                self.peak = max(self.peak, self.used)
                return offset, size
        return None

    def free(self, offset: int, size: int) -> None:
        """Return a region from ``allocate`` (its offset and reserved size)."""
        self.used -= size
        i = bisect.bisect_left(self._free, (offset, 0))
        if i < len(self._free) and offset + size == self._free[i][0]:
            size += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            offset, prev = self._free.pop(i - 1)
            size += prev
            i -= 1
        self._free.insert(i, (offset, size))

    @property
    def largest_free(self) -> int:
        return max((size for _, size in self._free), default=0)
