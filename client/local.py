"""Same-host fast path: read leased variants straight from the service's shared memory.

`KVClient.fetch_local(refs)` (and `AsyncKVClient.fetch_local`) asks the service to lease
the variants and copy them into its host-tier slab (`Locate` RPC), maps the slab
(/dev/shm/<segment>) once, and hands out tensors that alias it: no bytes cross gRPC and
nothing is copied. The tensors are valid while the lease is held (the `LocalFetch` /
`AsyncLocalFetch` context); copy what you keep longer.
"""

from __future__ import annotations

import threading
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

from kvclient.copy_stream import pin_host_memory
from kvclient.gpu_pool import GpuPool
from kvclient.tensors import TORCH_DTYPE
from kvcraft import tiers
from kvcraft.layout import layer_layout
from kvcraft.v1 import kvcraft_pb2 as pb


class SharedSlab:
    """The service's host tier, mapped into this process."""

    def __init__(self, segment: str) -> None:
        self.segment = segment
        self._shm = shared_memory.SharedMemory(name=segment)
        # Python < 3.13 registers attached segments with this process's resource tracker,
        # which would unlink the service's segment when this process exits.
        resource_tracker.unregister(self._shm._name, "shared_memory")  # noqa: SLF001
        # Page-locked in this process too (where CUDA exists), so copies of its layers into
        # GPU memory are asynchronous DMA (kvclient.copy_stream, docs/gpu.md).
        self._unpin = pin_host_memory(self._bytes())

    def layers(self, loc: pb.VariantLocation) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (K, V) aliasing the slab; layout as in docs/storage.md."""
        tokens = loc.key_spec.shape[1] if len(loc.key_spec.shape) > 1 else 0
        layout = layer_layout(loc.key_spec, loc.value_spec, tokens)
        kb = layout.key_bytes
        if layout.layer_bytes * loc.num_layers != loc.length:
            raise ValueError(f"variant {loc.variant_id}: {loc.length} bytes do not match its specs")
        if loc.offset + loc.length > self._shm.size:
            raise ValueError(f"variant {loc.variant_id}: bytes {loc.offset}..{loc.offset + loc.length} lie outside "
                             f"segment {self.segment} ({self._shm.size} bytes)")
        raw = self._bytes()[loc.offset : loc.offset + loc.length]
        k_dtype, v_dtype = TORCH_DTYPE[loc.key_spec.dtype], TORCH_DTYPE[loc.value_spec.dtype]
        out = []
        for layer in range(loc.num_layers):
            base = layout.offset(layer)
            k = raw[base : base + kb].view(k_dtype).view(*loc.key_spec.shape)
            v = raw[base + kb : base + layout.layer_bytes].view(v_dtype).view(*loc.value_spec.shape)
            out.append((k, v))
        return out

    def _bytes(self) -> torch.Tensor:
        """The whole segment as a uint8 tensor that holds an export of the mapping: while any
        tensor over it lives, `close` cannot unmap it (torch.frombuffer drops the export at
        once, so a tensor made by it would outlive the memory it points at)."""
        return torch.from_numpy(np.frombuffer(self._shm.buf, dtype=np.uint8))

    def close(self) -> None:
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        try:
            self._shm.close()
        except BufferError:
            # Tensors still alias it: they hold the mapping (through its memoryview), which is
            # unmapped when the last of them goes. Let go of it here; close the descriptor.
            self._shm._buf = self._shm._mmap = None  # noqa: SLF001
            self._shm.close()


class LocalMappings:
    """The service's shared memory as one client maps it: host slabs by segment name and
    gpu pools by CUDA IPC handle, each mapped once, for one service instance at a time.

    A Locate answered by another instance (the service restarted) retires every mapping
    of the one before: its offsets mean nothing in the new instance's memory. Retired
    slabs are closed at once (tensors still aliasing one keep it mapped); retired gpu
    pools stay open until `close()`, since unmapping CUDA memory under a live tensor
    would fault."""

    def __init__(self) -> None:
        self.instance_id = ""
        self._slabs: dict[str, SharedSlab] = {}
        self._gpu_pools: dict[bytes, GpuPool] = {}
        self._retired_pools: list[GpuPool] = []
        self._lock = threading.Lock()  # loader threads locate at once

    def of(self, r: pb.LocateResponse) -> tuple[SharedSlab, GpuPool | None]:
        """The host slab and gpu pool (None: not mapped here) that `r`'s offsets are in."""
        with self._lock:
            if r.instance_id != self.instance_id:
                self._retire()
                self.instance_id = r.instance_id
            return self._slab(r.segment), self._gpu_pool(r)

    def _slab(self, segment: str) -> SharedSlab:
        slab = self._slabs.get(segment)
        if slab is None:
            slab = self._slabs[segment] = SharedSlab(segment)
        return slab

    def _gpu_pool(self, r: pb.LocateResponse) -> GpuPool | None:
        """The service's gpu pool mapped here, when a located variant is in it and this
        process has CUDA; else None (those variants are read from the host slab)."""
        if not r.gpu_ipc_handle or not any(loc.gpu_length for loc in r.variants):
            return None
        if not torch.cuda.is_available():
            return None
        pool = self._gpu_pools.get(r.gpu_ipc_handle)
        if pool is None:
            pool = self._gpu_pools[r.gpu_ipc_handle] = GpuPool(r.gpu_ipc_handle, r.gpu_pool_bytes, r.gpu_device)
        return pool

    def _retire(self) -> None:
        for slab in self._slabs.values():
            slab.close()
        self._slabs.clear()
        self._retired_pools.extend(self._gpu_pools.values())
        self._gpu_pools.clear()

    def close(self) -> None:
        with self._lock:
            self._retire()
        for pool in self._retired_pools:
            pool.close()
        self._retired_pools.clear()


class _Located:
    """Per requested variant its layers, or None where the service could not place it in
    host memory (fetch that one with FetchLayers); the lease keeps the bytes in place.

    A variant held in the service's gpu tier comes as tensors in GPU memory instead,
    aliasing its pool (CUDA IPC, kvclient.gpu_pool), when this process has CUDA;
    `tier[i]` says which ("gpu", "host" or "" for none)."""

    def __init__(self, client, response: pb.LocateResponse, slab: SharedSlab,  # noqa: ANN001
                 gpu_pool: GpuPool | None = None) -> None:
        self._client = client
        self.lease_id = response.lease_id
        # The lease's end by the service's wall clock, which is this host's (Locate answers only
        # clients on its host): past it the service may move the bytes these tensors alias. The
        # service ends it by a clock no one sets, so it is counted here from now on the same kind
        # of clock (`held`): a wall clock stepped back would otherwise read a lease the service
        # has ended as still held.
        self.expires_unix_ms = response.lease_expires_unix_ms
        self._ends = time.monotonic() + (self.expires_unix_ms / 1000 - time.time())
        self.locations = list(response.variants)
        self.variant_ids = [loc.variant_id for loc in self.locations]
        self.layers: list = []
        self.tier: list[str] = []
        for loc in self.locations:
            if gpu_pool is not None and loc.gpu_length:
                key = (TORCH_DTYPE[loc.key_spec.dtype], tuple(loc.key_spec.shape))
                value = (TORCH_DTYPE[loc.value_spec.dtype], tuple(loc.value_spec.shape))
                self.layers.append(gpu_pool.layers(loc.gpu_offset, loc.gpu_length, loc.num_layers, key, value))
                self.tier.append(tiers.GPU)
            else:
                self.layers.append(slab.layers(loc) if loc.length else None)
                self.tier.append(tiers.HOST if loc.length else "")

    def held(self, margin_s: float = 0.0) -> bool:
        """The lease is not released and ends more than `margin_s` from now: the tensors
        still hold the variants' bytes (and will while a reader copies them)."""
        return bool(self.lease_id) and time.monotonic() + margin_s < self._ends

    def _take_lease(self) -> str:
        lease_id, self.lease_id = self.lease_id, ""
        return lease_id


class LocalFetch(_Located):
    """Result of `KVClient.fetch_local`; `release()` (or leaving the `with`) ends the lease."""

    def release(self) -> None:
        if lease_id := self._take_lease():
            self._client.release(lease_id)

    def __enter__(self) -> "LocalFetch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class AsyncLocalFetch(_Located):
    """Result of `AsyncKVClient.fetch_local`; `await release()` (or leaving the `async with`)
    ends the lease."""

    async def release(self) -> None:
        if lease_id := self._take_lease():
            await self._client.release(lease_id)

    async def __aenter__(self) -> "AsyncLocalFetch":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()
