"""Same-host fast path into the service's gpu tier: map its CUDA pool by IPC handle.

The service keeps its gpu tier in ONE device allocation and exports one CUDA IPC handle
for it (`kvservice.tiers.gpu.GpuTier.ipc_handle`). An engine on the same host opens the
handle once (`cuIpcOpenMemHandle`) and reads a leased variant's layers at (offset,
length) as tensors that alias the service's device memory: no copy at all, not even
over PCIe. Valid while the lease is held, like `kvclient.local`'s host-slab tensors;
copy what you keep longer.

The payload layout is the one of docs/storage.md (per layer: K bytes, then V bytes).
`IpcOpener` is the seam for tests: the CPU tests open a fake pool (tests/gpu).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Protocol

import torch

IPC_HANDLE_BYTES = 64
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1


class IpcOpener(Protocol):
    def open(self, handle: bytes, nbytes: int, device: int) -> torch.Tensor:
        """A uint8 tensor of `nbytes` aliasing the exported allocation."""
        ...

    def close(self, pool: torch.Tensor) -> None: ...


class _CuIpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


@dataclass
class _Span:
    ptr: int
    nbytes: int

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3, "strides": None}


class CudaIpcOpener:
    """cuIpcOpenMemHandle through the driver, in torch's (primary) context."""

    def __init__(self) -> None:
        self._lib = ctypes.CDLL("libcuda.so.1")
        # The handle is a 64-byte struct passed BY VALUE: say so, do not let ctypes guess.
        self._lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _CuIpcMemHandle, ctypes.c_uint]
        self._lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]

    def open(self, handle: bytes, nbytes: int, device: int) -> torch.Tensor:
        if len(handle) != IPC_HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        torch.cuda.set_device(device)
        torch.cuda.current_stream(device).synchronize()  # makes torch's context current on this thread
        h = _CuIpcMemHandle()
        ctypes.memmove(ctypes.addressof(h), handle, IPC_HANDLE_BYTES)
        ptr = ctypes.c_uint64()
        status = self._lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        if status != 0:
            raise RuntimeError(f"cuIpcOpenMemHandle failed with CUDA error {status}")
        return torch.as_tensor(_Span(ptr.value, nbytes), device=f"cuda:{device}")

    def close(self, pool: torch.Tensor) -> None:
        self._lib.cuIpcCloseMemHandle(ctypes.c_uint64(pool.data_ptr()))


def layer_views(raw: torch.Tensor, num_layers: int, key: tuple[torch.dtype, tuple[int, ...]],
                value: tuple[torch.dtype, tuple[int, ...]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) views of one payload's bytes (uint8 `raw`), docs/storage.md layout."""
    kb = math.prod(key[1]) * torch.finfo(key[0]).bits // 8
    vb = math.prod(value[1]) * torch.finfo(value[0]).bits // 8
    if (kb + vb) * num_layers != raw.numel():
        raise ValueError(f"{raw.numel()} bytes do not hold {num_layers} layers of K {key} and V {value}")
    out = []
    for layer in range(num_layers):
        base = layer * (kb + vb)
        k = raw[base : base + kb].view(key[0]).view(*key[1])
        v = raw[base + kb : base + kb + vb].view(value[0]).view(*value[1])
        out.append((k, v))
    return out


class GpuPool:
    """The service's gpu tier pool, mapped into this process."""

    def __init__(self, handle: bytes, nbytes: int, device: int = 0, opener: IpcOpener | None = None) -> None:
        self._opener = opener or CudaIpcOpener()
        self.device = device
        self.raw = self._opener.open(handle, nbytes, device)  # [nbytes] uint8

    def layers(self, offset: int, length: int, num_layers: int, key: tuple[torch.dtype, tuple[int, ...]],
               value: tuple[torch.dtype, tuple[int, ...]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (K, V) of the payload at [offset, offset + length), aliasing the pool."""
        if offset + length > self.raw.numel():
            raise ValueError(f"[{offset}, +{length}) lies outside the {self.raw.numel()}-byte gpu pool")
        return layer_views(self.raw[offset : offset + length], num_layers, key, value)

    def close(self) -> None:
        self._opener.close(self.raw)
