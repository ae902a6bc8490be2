"""Host-memory tier: payload copies of the hottest variants in one shared-memory slab.

The slab is a POSIX shared-memory segment (/dev/shm/<name>), so an engine on the same
host can map it and read a leased variant's layers with no copy through gRPC
(`Locate` RPC, `kvclient.local`). The segment is named after the data directory and
the service instance: a client that mapped an earlier instance's segment can never read
a new instance's offsets through it (the name differs), and a start removes every
segment an earlier instance of the same data directory left behind (a crash leaks it).

A writer allocates the variant's extent when it opens; layers are copied into it, or
read straight into it from the payload file (`SlabWriter.fill_layer`: a Store's copy at
commit, promotions from disk).
"""

from __future__ import annotations

import logging
from multiprocessing import shared_memory

from kvcraft import tiers
from kvservice.tiers.base import PayloadShape, SharedLocation
from kvservice.tiers.gpu_driver import CudaError, Driver, pin_host
from kvservice.tiers.slab import SlabTier

log = logging.getLogger("kvcraft.host")


class HostTier(SlabTier):
    name = tiers.HOST
    cache_on_store = True  # new stores are the likeliest next reads (and Locate maps them)
    mappable = True
    slab_name = "host slab"

    def __init__(self, budget_bytes: int, segment: str, driver: Driver | None = None) -> None:
        """`driver`: this process's CUDA driver (`gpu_driver.load()`), to page-lock the
        slab so copies from it into GPU memory are DMA at full speed; None: pageable."""
        super().__init__(budget_bytes, budget_bytes)
        self.shm = shared_memory.SharedMemory(name=segment, create=True, size=max(budget_bytes, 1))
        self.segment = segment
        self._unpin = _pin(self.shm.buf, driver)

    def _copy_in(self, offset: int, part: memoryview) -> None:
        self.shm.buf[offset : offset + part.nbytes] = part

    def _room(self, offset: int, n: int) -> memoryview:
        return self.shm.buf[offset : offset + n]

    def get_layers(self, variant_id: str, first: int, count: int, shape: PayloadShape) -> memoryview:
        start, length = self._span(variant_id, first, count, shape)
        return self.shm.buf[start : start + length]

    def mapping(self, variant_id: str) -> SharedLocation | None:
        where = self._where.get(variant_id)
        return None if where is None else SharedLocation(self.segment, *where)

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
