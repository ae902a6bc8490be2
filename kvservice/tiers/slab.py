"""First-fit allocator over one contiguous slab (the host tier's shared memory).

Free space is a sorted list of (offset, length) extents; freeing coalesces with both
neighbours, so equal-sized variants never fragment. Offsets are aligned to ALIGN bytes
so every layer a client maps from the slab starts on a cache line.
"""

from __future__ import annotations

import bisect

ALIGN = 64


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class SlabAllocator:
    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)] if size > 0 else []

    def alloc(self, n: int) -> int | None:
        """Offset of a free run of `n` bytes (rounded up to ALIGN), or None."""
        need = aligned(max(n, 1))
        for i, (off, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (off + need, length - need)
                return off
        return None

    def free(self, off: int, n: int) -> None:
        need = aligned(max(n, 1))
        i = bisect.bisect_left(self._free, (off, 0))
        start, end = off, off + need
        if i < len(self._free) and self._free[i][0] == end:  # merge with the next extent
            end += self._free[i][1]
            del self._free[i]
        if i > 0 and sum(self._free[i - 1]) == start:  # merge with the previous extent
            start = self._free[i - 1][0]
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (start, end - start))
