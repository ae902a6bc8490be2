"""Host-memory tier: payload copies of the hottest variants in one shared-memory slab.

The slab is a POSIX shared-memory segment (/dev/shm/<name>), so an engine on the same
host can map it and read a leased variant's layers with no copy through gRPC
(`Locate` RPC, `kvclient.local`). The segment is named after the data directory, so a
restart after a crash replaces the stale segment instead of leaking it.
"""

from __future__ import annotations

import hashlib
import threading
from multiprocessing import shared_memory
from pathlib import Path

from kvservice.tiers.base import Tier
from kvservice.tiers.slab import SlabAllocator, aligned


def segment_name(data_dir: Path) -> str:
    return "kvcraft-" + hashlib.sha1(str(Path(data_dir).resolve()).encode()).hexdigest()[:16]


class HostTier(Tier):
    name = "host"

    def __init__(self, budget_bytes: int, segment: str) -> None:
        super().__init__(budget_bytes)
        try:  # a segment left by a crashed run of this data dir
            stale = shared_memory.SharedMemory(name=segment)
            stale.close()
            stale.unlink()
        except FileNotFoundError:
            pass
        self.shm = shared_memory.SharedMemory(name=segment, create=True, size=max(budget_bytes, 1))
        self.segment = segment
        self._alloc = SlabAllocator(budget_bytes)
        self._where: dict[str, tuple[int, int]] = {}  # variant id -> (offset, length)
        self._used = 0
        self._lock = threading.Lock()

    def put(self, variant_id: str, payload: bytes | bytearray | memoryview) -> bool:
        """Copy the payload into the slab; False when no contiguous room is free."""
        n = len(payload)
        with self._lock:
            if variant_id in self._where:
                return True
            off = self._alloc.alloc(n)
            if off is None:
                return False
            self._where[variant_id] = (off, n)
            self._used += aligned(n)
        self.shm.buf[off : off + n] = payload
        return True

    def fits(self, n: int) -> bool:
        return self._alloc.largest_free() >= aligned(n)

    def read(self, variant_id: str, offset: int, length: int) -> memoryview:
        base, n = self._where[variant_id]
        if offset + length > n:
            raise KeyError(f"{variant_id}: read past the payload")
        return self.shm.buf[base + offset : base + offset + length]

    def location(self, variant_id: str) -> tuple[int, int]:
        """(offset, length) of the payload in the segment."""
        return self._where[variant_id]

    def delete(self, variant_id: str) -> None:
        with self._lock:
            where = self._where.pop(variant_id, None)
            if where is not None:
                self._alloc.free(*where)
                self._used -= aligned(where[1])

    def usage(self) -> int:
        return self._used

    def __contains__(self, variant_id: str) -> bool:
        return variant_id in self._where

    def close(self) -> None:
        try:
            self.shm.close()
        except BufferError:  # a view is still alive somewhere; the unlink below still frees it at exit
            pass
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass
