"""Test doubles for the CUDA-only modules (docs/gpu.md, "How it is tested").

`FakeDriver` stands in for `kvservice.tiers.gpu_driver.CudaDriver`: device memory is host
bytearrays at made-up, page-aligned addresses, so pointer arithmetic, bounds and
alignment are checked like on a device. `FakeKvikio` stands in for the `kvikio` module:
it records every CuFile.pread and performs it with POSIX into the fake device memory.
Everything above these seams (pool accounting, aligned windows, fallbacks) is real code.
"""

from __future__ import annotations

import os
import types

from kvservice.tiers.gpu_driver import host_address

_BASE = 0x7F00_0000_0000
_SPACING = 1 << 36


class FakeDriver:
    device = 0

    def __init__(self) -> None:
        self.allocations: dict[int, bytearray] = {}
        self.registered: dict[int, int] = {}  # host address -> length
        self.freed: list[int] = []
        self._next = _BASE

    def _span(self, ptr: int, n: int) -> tuple[bytearray, int]:
        for base, mem in self.allocations.items():
            if base <= ptr and ptr + n <= base + len(mem):
                return mem, ptr - base
        raise AssertionError(f"device access [{ptr:#x}, +{n}) outside every allocation")

    def alloc(self, nbytes: int) -> int:
        ptr = self._next
        self._next += _SPACING
        # Garbage, not zeros: a read of bytes nobody wrote shows up in comparisons.
        self.allocations[ptr] = bytearray(os.urandom(nbytes))
        return ptr

    def free(self, ptr: int) -> None:
        del self.allocations[ptr]
        self.freed.append(ptr)

    def htod(self, dst: int, src) -> None:  # noqa: ANN001
        data = bytes(memoryview(src).cast("B"))
        mem, off = self._span(dst, len(data))
        mem[off : off + len(data)] = data

    def dtoh(self, dst, src: int, nbytes: int) -> None:  # noqa: ANN001
        mem, off = self._span(src, nbytes)
        memoryview(dst)[:nbytes] = mem[off : off + nbytes]

    def host_register(self, buf) -> int:  # noqa: ANN001
        addr = host_address(buf)
        self.registered[addr] = memoryview(buf).nbytes
        return addr

    def host_unregister(self, host_ptr: int) -> None:
        del self.registered[host_ptr]

    def ipc_handle(self, ptr: int) -> bytes:
        assert ptr in self.allocations, "IPC handles exist only for the start of an allocation"
        return ptr.to_bytes(8, "little") + bytes(56)


class _Future:
    def __init__(self, n: int) -> None:
        self._n = n

    def get(self) -> int:
        return self._n


class FakeKvikio(types.ModuleType):
    """`kvikio` as far as the disk backend uses it."""

    def __init__(self, driver: FakeDriver, *, compat_mode: bool = True, fail: str | None = None) -> None:
        super().__init__("kvikio")
        self.preads: list[tuple[str, int, int, int]] = []  # (path, size, file_offset, device ptr)
        self.fail = fail
        outer = self
        self.defaults = types.ModuleType("kvikio.defaults")
        self.defaults.is_compat_mode_preferred = lambda: compat_mode

        class CuFile:
            def __init__(self, path: str, flags: str = "r") -> None:
                assert flags == "r"
                self.path = path

            def pread(self, buf, size: int, file_offset: int = 0) -> _Future:  # noqa: ANN001
                ptr = buf.__cuda_array_interface__["data"][0]
                outer.preads.append((self.path, size, file_offset, ptr))
                if outer.fail:
                    raise RuntimeError(outer.fail)
                with open(self.path, "rb") as f:
                    f.seek(file_offset)
                    data = f.read(size)
                assert len(data) == size, "a read past the end of the file"
                driver.htod(ptr, data)
                return _Future(len(data))

            def close(self) -> None:
                pass

        self.CuFile = CuFile


class FakeStream:
    """A CUDA stream that runs its work only when something waits for it."""

    def __init__(self, name: str, log: list) -> None:
        self.name = name
        self.log = log
        self.queue: list = []  # callables, in stream order

    def run_until(self, marker: object) -> None:
        while self.queue:
            op = self.queue.pop(0)
            if isinstance(op, FakeEvent):
                op.done = True
                if op is marker:
                    return
            else:
                op()

    def wait_event(self, event: "FakeEvent") -> None:
        self.log.append(("wait", self.name, event.tag))
        event.complete()

    def synchronize(self) -> None:
        self.run_until(object())


class FakeEvent:
    def __init__(self, tag: int) -> None:
        self.tag = tag
        self.stream: FakeStream | None = None
        self.done = False

    def record(self, stream: FakeStream) -> None:
        self.stream = stream
        stream.queue.append(self)

    def complete(self) -> None:
        assert self.stream is not None, "waited for an event never recorded"
        self.stream.run_until(self)
        self.done = True

    def query(self) -> bool:
        return self.done


class FakeCudaOps:
    """`kvclient.copy_stream.CudaOps` on CPU, with a device's asynchrony: a copy enqueued
    on a stream lands only when that stream's work runs (an event behind it is waited
    or the stream synchronized); until then its destination holds NaN."""

    def __init__(self) -> None:
        self.log: list = []
        self.compute = FakeStream("compute", self.log)
        self._current: list[FakeStream] = [self.compute]
        self._events = 0
        import threading

        self._lock = threading.Lock()

    def new_stream(self, device) -> FakeStream:  # noqa: ANN001
        return FakeStream("side", self.log)

    def new_event(self) -> FakeEvent:
        with self._lock:
            self._events += 1
            return FakeEvent(self._events - 1)

    def use_stream(self, stream: FakeStream):  # noqa: ANN201
        import contextlib

        @contextlib.contextmanager
        def ctx():  # noqa: ANN202
            self._current.append(stream)
            try:
                yield
            finally:
                self._current.remove(stream)

        return ctx()

    def current_stream(self, device) -> FakeStream:  # noqa: ANN001
        return self.compute

    def to_device(self, t, device):  # noqa: ANN001, ANN201
        import torch

        out = torch.full_like(t, float("nan"))
        stream = self._current[-1]
        self.log.append(("copy", stream.name))
        stream.queue.append(lambda: out.copy_(t))
        return out

    def record_stream(self, t, stream: FakeStream) -> None:  # noqa: ANN001
        self.log.append(("record_stream", stream.name))
