"""GPU tier: payload copies of the hottest variants in one CUDA memory pool (docs/gpu.md).

The pool is ONE device allocation of `gpu_budget_bytes`, carved first-fit like the host
slab (`kvservice.tiers.slab`), so one CUDA IPC handle (`ipc_handle()`) lets a same-host
engine map the whole pool once and read a leased variant at `location(vid)` with no
copy, the way `kvclient.local` maps the host slab. Every extent is a whole number of
4 KiB pages, so every variant starts on a page and GPUDirect Storage can read a payload
file straight into its place (`GpuWriter.fill_from`).

Device memory comes from the CUDA driver API (`gpu_driver`), not torch: the service never
imports torch. Like the host tier it holds copies; the store decides what goes where,
promotes into it (it is the fastest tier) and, when it needs room, moves its lowest-fr
copies one tier down into host.
"""

from __future__ import annotations

from kvcraft import tiers
from kvservice.records import GpuPool
from kvservice.tiers.base import PayloadShape, Tier, Verify
from kvservice.tiers.disk_backend import DiskBackend, align_up
from kvservice.tiers.gpu_driver import DeviceBuffer, Driver
from kvservice.tiers.slab import SlabTier, SlabWriter


class GpuWriter(SlabWriter):
    """Copies layers into a page-aligned extent reserved when the writer opens, or fills
    it straight from a payload file."""

    _tier: "GpuTier"

    def fill_from(self, source: Tier, variant_id: str, shape: PayloadShape, verify: Verify | None) -> bool:
        """Read the whole payload straight from `source`'s file into the pool with the disk
        backend (kvikio: DMA from the drive where GPUDirect Storage exists), then check
        each layer with `verify` (from a copy read back to host; a check never trusts
        bytes it did not see). False when this path does not apply (no disk backend, a
        source without files, layers already written): write layers instead."""
        backend = self._tier.disk_backend
        path = source.path_of(variant_id) if backend is not None and not self._pos else None
        if path is None:
            return False
        total = shape.total_bytes
        backend.read_into_device(path, 0, total,
                                 DeviceBuffer(self._tier.base + self._off, align_up(total)))
        self._pos = total
        if verify is not None:
            for layer in range(shape.num_layers):
                verify(layer, self._tier.read_back(self._off + shape.offset(layer), shape.layer_bytes))
        return True


class GpuTier(SlabTier):
    name = tiers.GPU
    cache_on_store = False  # device memory is scarce: it gets what Plan/Locate/fetches promote
    slab_name = "gpu pool"

    def __init__(self, budget_bytes: int, driver: Driver, disk_backend: DiskBackend | None = None) -> None:
        self.pool_bytes = align_up(max(budget_bytes, 1))
        # Extents are whole pages, so with a page-aligned pool every offset is page-aligned.
        super().__init__(budget_bytes, self.pool_bytes, align_up)
        self.driver = driver
        self.disk_backend = disk_backend
        self.base = driver.alloc(self.pool_bytes)
        self._ipc_handle: bytes | None = None

    def open_writer(self, variant_id: str, shape: PayloadShape) -> GpuWriter:
        return GpuWriter(self, variant_id, self._reserve(shape), shape)

    def _copy_in(self, offset: int, part: memoryview) -> None:
        self.driver.htod(self.base + offset, part)

    def read_back(self, offset: int, length: int) -> memoryview:
        out = bytearray(length)
        self.driver.dtoh(out, self.base + offset, length)
        return memoryview(out)

    def get_layers(self, variant_id: str, first: int, count: int, shape: PayloadShape) -> memoryview:
        """A host copy of the layers (FetchLayers to a remote engine, demotion into host);
        a same-host engine maps the pool instead."""
        return self.read_back(*self._span(variant_id, first, count, shape))

    def device_span(self, variant_id: str) -> DeviceBuffer:
        """The payload's device memory, for consumers in this process."""
        off, n = self._where[variant_id]
        return DeviceBuffer(self.base + off, n)

    def location(self, variant_id: str) -> tuple[int, int]:
        """(offset, length) of the payload in the pool: what an IPC peer needs."""
        return self._where[variant_id]

    def ipc_handle(self) -> bytes:
        """CUDA IPC handle of the whole pool; a peer opens it once (cuIpcOpenMemHandle)."""
        if self._ipc_handle is None:
            self._ipc_handle = self.driver.ipc_handle(self.base)
        return self._ipc_handle

    def ipc_pool(self) -> GpuPool:
        return GpuPool(self.ipc_handle(), self.pool_bytes, self.driver.device)

    def pool_location(self, variant_id: str) -> tuple[int, int] | None:
        return self._where.get(variant_id)

    def close(self) -> None:
        with self._lock:
            self._where.clear()
            self._used = 0
            base, self.base = self.base, 0
        if base:
            self.driver.free(base)
