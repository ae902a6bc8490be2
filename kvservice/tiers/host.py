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

import errno
import logging
import os
from multiprocessing import shared_memory

from kvcraft import tiers
from kvservice.segments import SHM_DIR
from kvservice.tiers.base import PayloadShape, SharedLocation, TierFull
from kvservice.tiers.gpu_driver import CudaError, Driver, pin_host
from kvservice.tiers.slab import SlabTier

log = logging.getLogger("kvcraft.host")
SHM_SHARE = 0.9  # of /dev/shm's free space at most, for the slab: the engine's own segments need some


class HostTier(SlabTier):
    name = tiers.HOST
    cache_on_store = True  # new stores are the likeliest next reads (and Locate maps them)
    mappable = True
    slab_name = "host slab"

    def __init__(self, budget_bytes: int, segment: str, driver: Driver | None = None) -> None:
        """`driver`: this process's CUDA driver (`gpu_driver.load()`), to page-lock the
        slab so copies from it into GPU memory are DMA at full speed; None: pageable."""
        budget_bytes = fitted_budget(budget_bytes)
        super().__init__(budget_bytes, budget_bytes)
        self.shm = shared_memory.SharedMemory(name=segment, create=True, size=max(budget_bytes, 1))
        self.segment = segment
        self._fd = os.open(SHM_DIR / segment, os.O_RDWR)
        self._backed = 0  # slab bytes [0, _backed) have memory behind them (`_back`)
        self._unpin = _pin(self.shm.buf, driver)

    def _back(self, offset: int, n: int) -> None:
        # The segment is sparse: a page nothing backs fails the copy that touches it (EFAULT
        # from a read into it, SIGBUS from a plain copy) once /dev/shm is full, which other
        # processes can make it after the start. Allocated here, a full /dev/shm is a full
        # tier: the copy makes room or is left out, and the variant is read from disk. The
        # allocator takes the start of a free run, so what it ever handed out is a prefix of
        # the slab: only an extent past the prefix's end costs an allocation, once.
        start, end = self._backed, offset + n
        if end <= start:
            return
        try:
            os.posix_fallocate(self._fd, start, end - start)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            raise TierFull(f"{SHM_DIR} has no room for {end - start:,} more bytes of the host slab") from None
        with self._lock:
            self._backed = max(self._backed, end)

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
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
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


def fitted_budget(budget_bytes: int) -> int:
    """The slab's size: `budget_bytes`, or at most SHM_SHARE of what /dev/shm has free. The
    segment is sparse, so a slab past that free space starts fine and fails later, at the
    first copy that touches a page the filesystem cannot back (EFAULT from a read into it,
    SIGBUS from a plain copy). A container's /dev/shm is 64 MiB unless it is given more."""
    st = os.statvfs(SHM_DIR)
    room = int(st.f_bavail * st.f_frsize * SHM_SHARE)
    if budget_bytes <= room:
        return budget_bytes
    log.warning("host_budget_bytes is %s but %s has %s bytes free: the host tier holds %s bytes. Give the "
                "shared memory room (docker run --shm-size, compose shm_size, a Kubernetes emptyDir of medium "
                "Memory at /dev/shm: docs/operations.md) or lower host_budget_bytes",
                f"{budget_bytes:,}", SHM_DIR, f"{st.f_bavail * st.f_frsize:,}", f"{room:,}")
    return room


def _pin(buf: memoryview, driver: Driver | None):  # noqa: ANN202 - the undo, or None
    try:
        return pin_host(buf, driver)
    except CudaError as e:  # e.g. RLIMIT_MEMLOCK; copies still work, at pageable speed
        log.warning("host slab not pinned: %s", e)
        return None
