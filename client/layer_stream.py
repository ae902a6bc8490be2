"""One client-side FetchLayers stream, read on background threads, consumed layer by layer.

    stream = LayerStream(client, refs, depth=2, deadline=time.monotonic() + 5.0)
    for layer in range(num_layers):
        got = stream.wait_layer(layer)      # {index in refs: (K, V)}; a late or missing variant is absent
    stream.close()

The one reader of FetchLayers that kvcraft's engine adapter (`engine_adapter.rag`)
and its vLLM connector (`engine_adapter.vllm`) share. The service sends layer-major
(every variant's layer 0, then layer 1, ...), so layer l is consumed while l+1.. are in
flight. Contract:

- refs: the variants, in order; `wait_layer` keys its answer by the position in `refs`.
  More refs than one request may carry (`max_refs_per_stream`, the service's
  max_fetch_variants) are read as several streams at once.
- depth: how many layers the reader may run ahead of the last layer handed out
  (Cache-Craft Alg. 2, preload depth Lp); None = no limit. Back-pressure only holds
  memory: a stream that waits for the consumer still ends at the deadline.
- deadline: `time.monotonic()` after which every stream is cancelled and `wait_layer`
  returns what it has. Nothing blocks past it.
- close(): idempotent, from any thread, also before a stream was opened (no stream is
  opened after it); joins the reader threads within a bound.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Sequence

from kvclient.messages import FetchedLayer, RefLike
from kvclient.errors import KVCraftError

log = logging.getLogger(__name__)

MAX_REFS_PER_STREAM = 256  # the service's default max_fetch_variants


class LayerStream:
    """FetchLayers for `refs`, buffered per layer (see the module docstring)."""

    def __init__(self, client: Any, refs: Sequence[RefLike], *, deadline: float, depth: int | None = None,
                 max_refs_per_stream: int = MAX_REFS_PER_STREAM, name: str = "kvcraft-fetch") -> None:
        self.refs = list(refs)
        self.deadline = deadline
        self.error: str | None = None
        self.arrived: dict[int, float] = {}    # layer -> seconds from start until every variant had it
        self.layer_bytes: dict[int, int] = {}  # layer -> K+V bytes received
        self._depth = depth
        self._buf: dict[int, dict[int, tuple[Any, Any]]] = {}
        self._cond = threading.Condition()
        self._consumed = -1
        self._closed = False
        self._running = 0
        self._calls: list[Any] = []
        self._t0 = time.monotonic()
        self._threads = []
        for off in range(0, len(self.refs), max_refs_per_stream):
            part = self.refs[off:off + max_refs_per_stream]
            t = threading.Thread(target=self._read, args=(client, off, part), name=name, daemon=True)
            self._threads.append(t)
        self._running = len(self._threads)
        for t in self._threads:
            t.start()

    # -- reader side -----------------------------------------------------------------------
    def _read(self, client: Any, off: int, part: list[RefLike]) -> None:
        try:
            with self._cond:
                if self._closed:
                    return
                left = self.deadline - time.monotonic()
                if left <= 0:
                    self._fail("deadline passed before the stream opened")
                    return
                # opened under the lock: close() either sees this call or runs before it
                call = client.fetch_layers(part, timeout=left)
                self._calls.append(call)
            for f in call:
                if not self._put(off, f):
                    return
        except KVCraftError as e:
            self._fail(str(e))
        except Exception as e:  # noqa: BLE001 - any reader failure is a missing layer, never a crash
            self._fail(f"{type(e).__name__}: {e}")
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def _put(self, off: int, f: FetchedLayer) -> bool:
        with self._cond:
            while (self._depth is not None and f.layer > self._consumed + self._depth and not self._closed
                   and time.monotonic() < self.deadline):
                self._cond.wait(max(0.0, self.deadline - time.monotonic()))
            if self._closed or time.monotonic() >= self.deadline:
                return False
            layer = self._buf.setdefault(f.layer, {})
            layer[off + f.index] = (f.key, f.value)
            self.layer_bytes[f.layer] = self.layer_bytes.get(f.layer, 0) + (
                f.key.numel() * f.key.element_size() + f.value.numel() * f.value.element_size())
            if len(layer) == len(self.refs):
                self.arrived[f.layer] = time.monotonic() - self._t0
            self._cond.notify_all()
            return True

    def _fail(self, why: str) -> None:
        with self._cond:
            if self.error is None and not self._closed:
                self.error = why[:300]
            self._cond.notify_all()

    # -- consumer side ---------------------------------------------------------------------
    def wait_layer(self, layer: int, deadline: float | None = None) -> dict[int, tuple[Any, Any]]:
        """Layer `layer` of every variant that arrived by min(deadline, the stream's
        deadline): {position in refs: (K, V)}. Hands the layer out (its buffer is freed)."""
        end = self.deadline if deadline is None else min(deadline, self.deadline)
        with self._cond:
            while len(self._buf.get(layer, ())) < len(self.refs) and self._running and not self._closed:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            got = self._buf.pop(layer, {})
            self._consumed = max(self._consumed, layer)
            self._cond.notify_all()
        return got

    def close(self, join_s: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            calls = list(self._calls)
            self._cond.notify_all()
        for c in calls:
            c.cancel()
        end = time.monotonic() + join_s
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=max(0.0, end - time.monotonic()))
