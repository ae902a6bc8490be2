"""Host-memory tier: payload copies of the hottest variants in one shared-memory slab.

The slab is a POSIX shared-memory segment (/dev/shm/<name>), so an engine on the same
host can map it and read a leased variant's layers with no copy through gRPC
(`Locate` RPC, `kvclient.local`). The segment is named after the data directory, so a
restart after a crash replaces the stale segment instead of leaking it.

A writer allocates the variant's extent when it opens and copies each layer straight
into it, so a Store fills the slab from the same buffer it writes to disk.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from multiprocessing import shared_memory
from pathlib import Path

from kvcraft import tiers
from kvservice.tiers.base import Buffer, PayloadShape, SharedLocation, Tier, TierFull, TierWriter
from kvservice.tiers.gpu_driver import CudaError, Driver, pin_host
from kvservice.tiers.slab import SlabAllocator, aligned

log = logging.getLogger("kvcraft.host")


def segment_name(data_dir: Path) -> str:
    return "kvcraft-" + hashlib.sha1(str(Path(data_dir).resolve()).encode()).hexdigest()[:16]


class HostWriter(TierWriter):
    """Copies layers into an extent allocated up front; `commit` makes it readable."""

    def __init__(self, tier: "HostTier", variant_id: str, offset: int, shape: PayloadShape) -> None:
        self._tier = tier
        self._vid = variant_id
        self._off = offset
        self._shape = shape
        self._pos = 0
        self._open = True

    def write_layer(self, *parts: Buffer) -> None:
        buf = self._tier.shm.buf
        for p in parts:
            n = len(p) if not isinstance(p, memoryview) else p.nbytes
            start = self._off + self._pos
            if self._pos + n > self._shape.total_bytes:
                raise ValueError(f"{self._vid}: write past the payload's {self._shape.total_bytes} bytes")
            buf[start : start + n] = p if not isinstance(p, memoryview) else p.cast("B")
            self._pos += n

    def commit(self) -> None:
        if self._pos != self._shape.total_bytes:
            raise ValueError(f"{self._vid}: {self._pos} bytes written, {self._shape.total_bytes} expected")
        self._open = False
        self._tier._publish(self._vid, self._off, self._shape.total_bytes)

    def abort(self) -> None:
        if self._open:
            self._open = False
            self._tier._release(self._off, self._shape.total_bytes)


class HostTier(Tier):
    name = tiers.HOST
    cache_on_store = True  # new stores are the likeliest next reads (and Locate maps them)
    mappable = True

    def __init__(self, budget_bytes: int, segment: str, driver: Driver | None = None) -> None:
        """`driver`: this process's CUDA driver (`gpu_driver.load()`), to page-lock the
        slab so copies from it into GPU memory are DMA at full speed; None: pageable."""
        super().__init__(budget_bytes)
        try:  # a segment left by a crashed run of this data dir
            stale = shared_memory.SharedMemory(name=segment)
            stale.close()
            stale.unlink()
        except FileNotFoundError:
            pass
        self.shm = shared_memory.SharedMemory(name=segment, create=True, size=max(budget_bytes, 1))
        self.segment = segment
        self._unpin = _pin(self.shm.buf, driver)
        self._alloc = SlabAllocator(budget_bytes)
        self._where: dict[str, tuple[int, int]] = {}  # variant id -> (offset, length)
        self._used = 0  # aligned bytes of committed copies (open writers hold extents too)
        self._lock = threading.Lock()

    def open_writer(self, variant_id: str, shape: PayloadShape) -> HostWriter:
        n = shape.total_bytes
        with self._lock:
            off = self._alloc.alloc(n)
            if off is None:
                raise TierFull(f"host slab has no free run of {aligned(n)} bytes")
        return HostWriter(self, variant_id, off, shape)

    def _publish(self, variant_id: str, off: int, n: int) -> None:
        with self._lock:
            old = self._where.get(variant_id)
            self._where[variant_id] = (off, n)
            self._used += aligned(n)
        if old is not None:  # a second copy of the same variant: keep the new one
            self._release(*old, committed=True)

    def _release(self, off: int, n: int, committed: bool = False) -> None:
        with self._lock:
            self._alloc.free(off, n)
            if committed:
                self._used -= aligned(n)

    def get_layer(self, variant_id: str, layer: int, shape: PayloadShape) -> memoryview:
        return self.get_layers(variant_id, layer, 1, shape)

    def get_layers(self, variant_id: str, first: int, count: int, shape: PayloadShape) -> memoryview:
        base, n = self._where[variant_id]
        start, length = shape.offset(first), count * shape.layer_bytes
        if start + length > n:
            raise KeyError(f"{variant_id}: read past the payload")
        return self.shm.buf[base + start : base + start + length]

    def mapping(self, variant_id: str) -> SharedLocation | None:
        where = self._where.get(variant_id)
        return None if where is None else SharedLocation(self.segment, *where)

    def delete(self, variant_id: str) -> None:
        with self._lock:
            where = self._where.pop(variant_id, None)
        if where is not None:
            self._release(*where, committed=True)

    def usage(self) -> int:
        return self._used

    def __contains__(self, variant_id: object) -> bool:
        return variant_id in self._where

    def close(self) -> None:
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        try:
            self.shm.close()
        except BufferError:  # a view is still alive somewhere; the unlink below still frees it at exit
            pass
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass


def _pin(buf: memoryview, driver: Driver | None):  # noqa: ANN202 - the undo, or None
    try:
        return pin_host(buf, driver)
    except CudaError as e:  # e.g. RLIMIT_MEMLOCK; copies still work, at pageable speed
        log.warning("host slab not pinned: %s", e)
        return None
