"""The CUDA driver API through ctypes: the service's only door to a GPU (docs/gpu.md).

The service never imports torch (docs/architecture.md), yet the gpu tier needs device
memory, the host slab needs page-locking and same-host engines need IPC handles. All of
that is a dozen calls of the CUDA driver API (`libcuda.so.1`, installed with the NVIDIA
driver on every GPU host), so this module binds exactly those with ctypes: no torch, no
cupy, no CUDA toolkit. It is imported lazily, only by the gpu-side modules.

`load()` opens the driver once per process. Without it (every CPU machine, CI) it
returns None and logs ONE line saying why and what is off, so the gpu tier stays off,
the slab stays pageable and disk reads stay POSIX without further noise.

`CudaDriver` is also the seam the CPU tests replace (tests/gpu/fakes.py): everything
above it — pool accounting, alignment, fallbacks — runs on CPU against a fake device.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Protocol

log = logging.getLogger("kvcraft.gpu")

IPC_HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE
CU_MEMHOSTREGISTER_PORTABLE = 0x01  # pinned for every CUDA context in the process
CUDA_SUCCESS = 0


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


class Driver(Protocol):
    """What the gpu-side modules need from CUDA. Device pointers are ints."""

    device: int

    def alloc(self, nbytes: int) -> int: ...
    def free(self, ptr: int) -> None: ...
    def htod(self, dst: int, src: memoryview | bytes | bytearray) -> None: ...
    def dtoh(self, dst: memoryview | bytearray, src: int, nbytes: int) -> None: ...
    def host_register(self, buf: memoryview) -> int: ...
    def host_unregister(self, host_ptr: int) -> None: ...
    def ipc_handle(self, ptr: int) -> bytes: ...


def host_address(buf: memoryview | bytes | bytearray) -> int:
    """Address of a contiguous host buffer (read-only buffers too)."""
    import numpy as np  # noqa: PLC0415 - only on the GPU path: the service starts without it

    view = memoryview(buf)
    return int(np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data) if view.nbytes else 0


@dataclass
class DeviceBuffer:
    """A span of device memory in the form kvikio and torch accept (CUDA array interface)."""

    ptr: int
    nbytes: int

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                "version": 3, "strides": None}


class CudaDriver:
    """The real driver: one device's primary context, made current on each calling thread."""

    def __init__(self, lib: ctypes.CDLL, device: int) -> None:
        self._lib = lib
        self.device = device
        self._check("cuInit", lib.cuInit(0))
        count = ctypes.c_int()
        self._check("cuDeviceGetCount", lib.cuDeviceGetCount(ctypes.byref(count)))
        if not 0 <= device < count.value:
            raise CudaError(f"gpu_device {device} does not exist: the driver sees {count.value} device(s)")
        dev = ctypes.c_int()
        self._check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), device))
        # The primary context is the one torch and kvikio use too, so pointers allocated
        # here are valid for them in the same process.
        self._ctx = ctypes.c_void_p()
        self._check("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(self._ctx), dev))
        self._current = threading.local()

    def _check(self, call: str, status: int) -> None:
        if status != CUDA_SUCCESS:
            msg = ctypes.c_char_p()
            self._lib.cuGetErrorString(status, ctypes.byref(msg))
            raise CudaError(f"{call} failed: {(msg.value or b'').decode() or status}")

    def _enter(self) -> None:
        if not getattr(self._current, "set", False):
            self._check("cuCtxSetCurrent", self._lib.cuCtxSetCurrent(self._ctx))
            self._current.set = True

    def alloc(self, nbytes: int) -> int:
        self._enter()
        ptr = ctypes.c_uint64()
        self._check("cuMemAlloc", self._lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)))
        return ptr.value

    def free(self, ptr: int) -> None:
        self._enter()
        self._check("cuMemFree", self._lib.cuMemFree_v2(ctypes.c_uint64(ptr)))

    def htod(self, dst: int, src: memoryview | bytes | bytearray) -> None:
        self._enter()
        n = memoryview(src).nbytes
        self._check("cuMemcpyHtoD", self._lib.cuMemcpyHtoD_v2(
            ctypes.c_uint64(dst), ctypes.c_void_p(host_address(src)), ctypes.c_size_t(n)))

    def dtoh(self, dst: memoryview | bytearray, src: int, nbytes: int) -> None:
        self._enter()
        self._check("cuMemcpyDtoH", self._lib.cuMemcpyDtoH_v2(
            ctypes.c_void_p(host_address(dst)), ctypes.c_uint64(src), ctypes.c_size_t(nbytes)))

    def host_register(self, buf: memoryview) -> int:
        """Page-lock `buf` for DMA (cudaHostRegister); returns the address to unregister."""
        self._enter()
        addr = host_address(buf)
        self._check("cuMemHostRegister", self._lib.cuMemHostRegister_v2(
            ctypes.c_void_p(addr), ctypes.c_size_t(memoryview(buf).nbytes), CU_MEMHOSTREGISTER_PORTABLE))
        return addr

    def host_unregister(self, host_ptr: int) -> None:
        self._enter()
        self._check("cuMemHostUnregister", self._lib.cuMemHostUnregister(ctypes.c_void_p(host_ptr)))

    def ipc_handle(self, ptr: int) -> bytes:
        """The CUDA IPC handle of the allocation starting at `ptr` (64 opaque bytes)."""
        self._enter()
        handle = (ctypes.c_char * IPC_HANDLE_BYTES)()
        self._check("cuIpcGetMemHandle", self._lib.cuIpcGetMemHandle(handle, ctypes.c_uint64(ptr)))
        return bytes(handle)


_lock = threading.Lock()
_loaded: dict[int, CudaDriver | None] = {}
_reason: str | None = None


def unavailable_reason() -> str | None:
    """Why `load()` returned None (None if it did not, or was not called)."""
    return _reason


def load(device: int = 0) -> CudaDriver | None:
    """The process's driver for `device`, or None (logged once) where CUDA is absent."""
    global _reason
    with _lock:
        if device in _loaded:
            return _loaded[device]
        drv: CudaDriver | None = None
        try:
            drv = CudaDriver(ctypes.CDLL("libcuda.so.1"), device)
        except (OSError, CudaError) as e:
            _reason = str(e)
            log.info("no usable CUDA driver (%s): gpu tier off, host slab not pinned, "
                     "disk reads through POSIX", e)
        _loaded[device] = drv
        return drv


def pin_host(buf: memoryview, driver: Driver | None) -> Callable[[], None] | None:
    """Page-lock `buf` (cudaHostRegister) so copies between it and GPU memory are DMA at
    full PCIe speed; returns the undo to call before the memory goes away, or None when
    there is no driver. Registration is per process: each process pins its own mapping."""
    if driver is None or not memoryview(buf).nbytes:
        return None
    addr = driver.host_register(buf)
    return lambda: driver.host_unregister(addr)
