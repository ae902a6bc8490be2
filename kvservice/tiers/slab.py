"""Slab tiers: copies in extents of one contiguous slab (the host tier's shared memory,
the gpu tier's device pool), carved by a first-fit allocator.

Free space is a sorted list of (offset, length) extents; freeing coalesces with both
neighbours, so equal-sized variants never fragment. Offsets are aligned to ALIGN bytes
so every layer a client maps from the slab starts on a cache line.
"""

from __future__ import annotations

import bisect
import threading
from typing import Callable

from kvservice.tiers.base import Buffer, PayloadShape, Tier, TierFull, TierWriter

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


class SlabTier(Tier):
    """A tier whose copies live in extents of one contiguous slab (the host tier's shared
    memory, the gpu tier's device pool): the extent bookkeeping both share. Subclasses
    say how bytes get into the slab (`_copy_in`) and how reads see them."""

    slab_name = "slab"  # in TierFull messages

    def __init__(self, budget_bytes: int, slab_bytes: int, round_up: Callable[[int], int] = aligned) -> None:
        """round_up: the extent size of a payload (the allocator's alignment or more)."""
        super().__init__(budget_bytes)
        self._round = round_up
        self._alloc = SlabAllocator(slab_bytes)
        self._where: dict[str, tuple[int, int]] = {}  # variant id -> (offset, length)
        self._used = 0  # rounded bytes of committed copies (open writers hold extents too)
        self._lock = threading.Lock()

    def _copy_in(self, offset: int, part: memoryview) -> None:
        """Copy `part` (bytes, 1-D) into the slab at `offset`."""
        raise NotImplementedError

    def _room(self, offset: int, n: int) -> memoryview | None:
        """Slab bytes [offset, offset + n) as writable host memory, or None where the
        slab is not host memory (the gpu pool)."""
        return None

    def open_writer(self, variant_id: str, shape: PayloadShape) -> "SlabWriter":
        return SlabWriter(self, variant_id, self._reserve(shape), shape)

    def _reserve(self, shape: PayloadShape) -> int:
        need = self._round(shape.total_bytes)
        with self._lock:
            off = self._alloc.alloc(need)
        if off is None:
            raise TierFull(f"{self.slab_name} has no free run of {need} bytes")
        try:
            self._back(off, need)
        except TierFull:
            with self._lock:
                self._alloc.free(off, need)
            raise
        return off

    def _back(self, offset: int, n: int) -> None:
        """Make sure memory backs slab bytes [offset, offset + n) before a copy touches them;
        TierFull if it cannot."""

    def _publish(self, variant_id: str, off: int, n: int) -> None:
        with self._lock:
            old = self._where.get(variant_id)
            self._where[variant_id] = (off, n)
            self._used += self._round(n)
        if old is not None:  # a second copy of the same variant: keep the new one
            self._release(*old, committed=True)

    def _release(self, off: int, n: int, committed: bool = False) -> None:
        with self._lock:
            self._alloc.free(off, self._round(n))
            if committed:
                self._used -= self._round(n)

    def _span(self, variant_id: str, first: int, count: int, shape: PayloadShape) -> tuple[int, int]:
        """(slab offset, length) of layers [first, first + count) of a held variant."""
        base, n = self._where[variant_id]
        start, length = shape.offset(first), count * shape.layer_bytes
        if start + length > n:
            raise KeyError(f"{variant_id}: read past the payload")
        return base + start, length

    def get_layer(self, variant_id: str, layer: int, shape: PayloadShape) -> memoryview:
        return self.get_layers(variant_id, layer, 1, shape)

    def delete(self, variant_id: str) -> None:
        with self._lock:
            where = self._where.pop(variant_id, None)
        if where is not None:
            self._release(*where, committed=True)

    def usage(self) -> int:
        return self._used

    def __contains__(self, variant_id: object) -> bool:
        return variant_id in self._where

    def __len__(self) -> int:
        return len(self._where)

    def variant_ids(self) -> list[str]:
        with self._lock:
            return list(self._where)


class SlabWriter(TierWriter):
    """Copies layers into an extent reserved when the writer opens; `commit` makes it
    readable, `abort` frees the extent."""

    def __init__(self, tier: SlabTier, variant_id: str, offset: int, shape: PayloadShape) -> None:
        self._tier = tier
        self._vid = variant_id
        self._off = offset
        self._shape = shape
        self._pos = 0
        self._open = True

    def write_layer(self, *parts: Buffer) -> None:
        for p in parts:
            view = memoryview(p).cast("B")
            if self._pos + view.nbytes > self._shape.total_bytes:
                raise ValueError(f"{self._vid}: write past the payload's {self._shape.total_bytes} bytes")
            self._tier._copy_in(self._off + self._pos, view)
            self._pos += view.nbytes

    def fill_layer(self, read: Callable[[memoryview], None]) -> memoryview | None:
        """Fill the next layer in place: `read(room)` puts its bytes straight into the
        slab (one copy, e.g. a pread from the payload file). Returns the filled room
        (to verify), or None, having done nothing, where the slab is not host memory
        (the gpu pool)."""
        n = self._shape.layer_bytes
        if self._pos + n > self._shape.total_bytes:
            raise ValueError(f"{self._vid}: write past the payload's {self._shape.total_bytes} bytes")
        room = self._tier._room(self._off + self._pos, n)
        if room is None:
            return None
        read(room)
        self._pos += n
        return room

    def commit(self) -> None:
        if self._pos != self._shape.total_bytes:
            raise ValueError(f"{self._vid}: {self._pos} bytes written, {self._shape.total_bytes} expected")
        self._open = False
        self._tier._publish(self._vid, self._off, self._shape.total_bytes)

    def abort(self) -> None:
        if self._open:
            self._open = False
            self._tier._release(self._off, self._shape.total_bytes)
