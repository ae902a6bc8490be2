"""Layer-wise copies of fetched KV into GPU memory on a side CUDA stream (docs/gpu.md).

The engine computes layer l while layer l+1 copies (CacheBlend §5, Cache-Craft Alg. 2):

    side stream:     [copy l] (event l) [copy l+1] (event l+1) ...
    compute stream:  ... wait(event l) [layer l] wait(event l+1) [layer l+1] ...

`LayerCopyStream.submit(l, kv)` enqueues the host->GPU copies of layer l on the side
stream and records event l behind them; `take(l)` makes the compute stream wait for
event l (a GPU-side wait: the CPU does not block) and only then hands the GPU tensors
out. Nothing may read layer l's tensors before `take(l)`; that ordering is the
contract, and tests/gpu/test_copy_stream.py checks it against a fake device whose
copies only land when the event is waited.

`GpuLayerSource` puts a copy stream behind any LayerSource (engine_adapter.source):
a feeder thread pulls host layers up to `depth` ahead of the layer being computed and
submits them, so copies run while the engine is still busy with earlier layers. The
vLLM connector's worker side uses `LayerCopyStream` directly for the same ordering.

Host tensors should be pinned for the copies to be asynchronous and at full PCIe speed:
`pin_host_memory` page-locks memory this process did not allocate (e.g. the service's
host slab mapped by `kvclient.local`; pinning is per process, so the engine pins its
own mapping). Host tensors are kept alive until their copy is known to be complete.
"""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager
from typing import Any, Callable, Protocol

import torch
from torch import Tensor

LayerKV = dict[int, tuple[Tensor, Tensor]]  # chunk index -> (K, V); as engine_adapter.source


class CudaOps(Protocol):
    """The CUDA calls the copy stream makes (torch.cuda in production, a fake in tests)."""

    def new_stream(self, device: torch.device) -> Any: ...
    def new_event(self) -> Any: ...
    def use_stream(self, stream: Any) -> AbstractContextManager: ...
    def current_stream(self, device: torch.device) -> Any: ...
    def to_device(self, t: Tensor, device: torch.device) -> Tensor: ...
    def record_stream(self, t: Tensor, stream: Any) -> None: ...


class TorchCudaOps:
    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def use_stream(self, stream: Any) -> AbstractContextManager:
        return torch.cuda.stream(stream)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def to_device(self, t: Tensor, device: torch.device) -> Tensor:
        # Asynchronous only from pinned memory; from pageable memory torch stages it.
        return t.to(device, non_blocking=True)

    def record_stream(self, t: Tensor, stream: Any) -> None:
        # The tensor was allocated on the side stream; tell the caching allocator the
        # compute stream uses it too, so its memory is not reused under the compute.
        t.record_stream(stream)


class LayerCopyStream:
    """Host->GPU copies of whole layers on one side stream, one event per layer."""

    def __init__(self, device: torch.device | str, ops: CudaOps | None = None) -> None:
        self.device = torch.device(device)
        self.ops = ops or TorchCudaOps()
        self.stream = self.ops.new_stream(self.device)
        self._pending: dict[int, tuple[LayerKV, Any, LayerKV]] = {}  # layer -> (gpu, event, host)
        self._in_flight: list[tuple[Any, LayerKV]] = []  # (event, host tensors) of taken layers
        self._lock = threading.Lock()

    def submit(self, layer: int, kv: LayerKV) -> None:
        """Enqueue layer `layer`'s copies on the side stream; returns at once."""
        with self.ops.use_stream(self.stream):
            gpu = {c: (self.ops.to_device(k, self.device), self.ops.to_device(v, self.device))
                   for c, (k, v) in kv.items()}
            event = self.ops.new_event()
            event.record(self.stream)
        with self._lock:
            if layer in self._pending:
                raise ValueError(f"layer {layer} was already submitted")
            self._pending[layer] = (gpu, event, kv)

    def submitted(self, layer: int) -> bool:
        with self._lock:
            return layer in self._pending

    def take(self, layer: int) -> LayerKV:
        """Layer `layer` on the GPU, safe to use on the current (compute) stream."""
        with self._lock:
            gpu, event, host = self._pending.pop(layer)
            self._in_flight = [(e, h) for e, h in self._in_flight if not e.query()]
            self._in_flight.append((event, host))  # the host side lives until the copy is done
        compute = self.ops.current_stream(self.device)
        compute.wait_event(event)
        for k, v in gpu.values():
            self.ops.record_stream(k, compute)
            self.ops.record_stream(v, compute)
        return gpu

    def close(self) -> None:
        """Wait for every copy in flight and drop what was never taken."""
        self.stream.synchronize()
        with self._lock:
            self._pending.clear()
            self._in_flight.clear()


def pin_host_memory(t: Tensor) -> Callable[[], None] | None:
    """Page-lock the memory behind a CPU tensor allocated elsewhere (cudaHostRegister),
    so copies from it are DMA at full speed. Returns the undo, or None without CUDA."""
    if not torch.cuda.is_available() or t.numel() == 0:
        return None
    cudart = torch.cuda.cudart()
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    err = cudart.cudaHostRegister(ptr, nbytes, 1)  # cudaHostRegisterPortable
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {err}")
    return lambda: cudart.cudaHostUnregister(ptr)


class LayerSource(Protocol):  # engine_adapter.source.LayerSource, restated: kvclient sits below it
    def wait_layer(self, layer: int, deadline: float) -> LayerKV: ...


class GpuLayerSource:
    """A LayerSource whose layers arrive in GPU memory, copied on a side stream.

    A feeder thread asks `inner` for layer l (host tensors, e.g. a FetchLayers stream or
    the mapped host slab) as soon as the engine is within `depth` layers of it and
    submits the copy; `wait_layer(l)` waits for the submission (or the deadline) and
    takes the layer. A layer the inner source could not deliver in time is absent,
    as with any LayerSource: the engine computes it.
    """

    def __init__(self, inner: LayerSource, num_layers: int, device: torch.device | str, *,
                 depth: int = 1, ops: CudaOps | None = None, feed_timeout_s: float = 60.0) -> None:
        self.copies = LayerCopyStream(device, ops)
        self._inner = inner
        self._layers = num_layers
        self._depth = max(1, depth)
        self._feed_timeout_s = feed_timeout_s
        self._cond = threading.Condition()
        self._consumed = -1
        self._done = False
        self._fed = -1  # last layer submitted
        self._thread = threading.Thread(target=self._feed, name="kvcraft-copy", daemon=True)
        self._thread.start()

    def _feed(self) -> None:
        try:
            for layer in range(self._layers):
                with self._cond:
                    while layer > self._consumed + self._depth and not self._done:
                        self._cond.wait()
                    if self._done:
                        return
                kv = self._inner.wait_layer(layer, time.monotonic() + self._feed_timeout_s)
                self.copies.submit(layer, kv)
                with self._cond:
                    self._fed = layer
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def wait_layer(self, layer: int, deadline: float) -> LayerKV:
        with self._cond:
            while self._fed < layer and not self._done:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            self._consumed = layer
            self._cond.notify_all()
        return self.copies.take(layer) if self.copies.submitted(layer) else {}

    def close(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        self.copies.close()
