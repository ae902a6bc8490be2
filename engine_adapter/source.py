"""Where the reused chunks' stored KV comes from, one layer at a time."""

from __future__ import annotations

import time
from typing import Iterable, Mapping, Protocol, Sequence

from torch import Tensor

LayerKV = dict[int, tuple[Tensor, Tensor]]


class LayerSource(Protocol):
    def wait_layer(self, layer: int, deadline: float) -> LayerKV:
        """KV of `layer` for each reused chunk (chunk index -> (K [Hkv,T,D] RoPE-free, V)),
        blocking at most until `deadline` (time.monotonic()). Chunks missing, late or
        corrupt are simply absent from the dict.

        Called once per layer, in layer order, only while some reused chunk is still
        served from the cache. Chunk indices are segment indices of the prompt.
        """
        ...

    def close(self) -> None:
        """Stop fetching and free what is buffered; idempotent. The caller calls it once the
        prefill is done (or failed), whatever was consumed."""
        ...


def holds(source: object) -> bool:
    """Whether the layers `source` handed out still hold its bytes. A source whose tensors
    alias memory that is another's once a lease ends (`loader.ServiceLayerSource`) says so
    with a `holds()` of its own; any other's layers are the consumer's."""
    check = getattr(source, "holds", None)
    return True if check is None else check()


class InMemoryLayerSource:
    """Every layer already in memory: chunk index -> per-layer (K RoPE-free, V).

    `withhold` lists (chunk, layer) pairs that never arrive: the same thing the
    driver sees from a fetch that misses its deadline, so tests need no sleeping.
    """

    def __init__(self, kv: Mapping[int, Sequence[tuple[Tensor, Tensor]]],
                 withhold: Iterable[tuple[int, int]] = ()):
        self.kv = dict(kv)
        self.withhold = set(withhold)
        self.requested: list[int] = []  # layers asked for, in order

    def wait_layer(self, layer: int, deadline: float) -> LayerKV:
        self.requested.append(layer)
        return {c: layers[layer] for c, layers in self.kv.items() if (c, layer) not in self.withhold}

    def close(self) -> None:
        pass


class RecordingLayerSource:
    """Another source's layers, passed through and copied as they arrive: the stored KV one
    request was served from, for the shadow's blend of the same request at another budget
    (`engine_adapter.fidelity`). The copies are taken before the prefill touches the layers
    (and before a shared-memory lease is released)."""

    def __init__(self, source: LayerSource):
        self.source = source
        self.kv: dict[int, dict[int, tuple[Tensor, Tensor]]] = {}  # chunk -> layer -> (K, V)

    def wait_layer(self, layer: int, deadline: float) -> LayerKV:
        got = self.source.wait_layer(layer, deadline)
        for chunk, (k, v) in got.items():
            self.kv.setdefault(chunk, {})[layer] = (k.clone(), v.clone())
        return got

    def close(self) -> None:
        self.source.close()

    def holds(self) -> bool:
        return holds(self.source)

    def replay(self) -> "RecordedLayerSource":
        return RecordedLayerSource(self.kv)


class RecordedLayerSource:
    """The layers a `RecordingLayerSource` saw, served again at once; a (chunk, layer) that
    did not arrive then does not arrive now."""

    def __init__(self, kv: Mapping[int, Mapping[int, tuple[Tensor, Tensor]]]):
        self.kv = kv

    def wait_layer(self, layer: int, deadline: float) -> LayerKV:
        return {c: layers[layer] for c, layers in self.kv.items() if layer in layers}

    def close(self) -> None:
        pass


class ReplayLayerSource:
    """Another source read once for a prefill of several passes: a layer asked for the first
    time comes from `source` and is kept (the loop asks for each layer once, in order, while a
    chunk is live); asked again by a later pass, it is handed out as kept."""

    def __init__(self, source: LayerSource) -> None:
        self.source = source
        self.received: list[LayerKV] = []

    def wait_layer(self, layer: int, deadline: float) -> LayerKV:
        if layer < len(self.received):
            # a later pass once the source's lease has ended: absent, so the consumer computes it
            return self.received[layer] if holds(self.source) else {}
        got = self.source.wait_layer(layer, deadline)
        if layer == len(self.received):
            self.received.append(got)
        return got

    def close(self) -> None:
        pass  # the caller closes the source


class ScheduledLayerSource(InMemoryLayerSource):
    """In memory, but layer l only "arrives" at start + (l + 1) * layer_interval_s: a stand-in
    for a layer-wise fetch from a slower tier (benchmarks, the docs timeline). Blocks until
    the layer arrives or the deadline passes, whichever is first; late layers are absent.
    """

    def __init__(self, kv: Mapping[int, Sequence[tuple[Tensor, Tensor]]], layer_interval_s: float,
                 start: float | None = None, withhold: Iterable[tuple[int, int]] = ()):
        super().__init__(kv, withhold)
        self.interval = layer_interval_s
        self.start = time.monotonic() if start is None else start

    def wait_layer(self, layer: int, deadline: float) -> LayerKV:
        ready = self.start + (layer + 1) * self.interval
        time.sleep(max(0.0, min(ready, deadline) - time.monotonic()))
        if ready > deadline:
            self.requested.append(layer)
            return {}
        return super().wait_layer(layer, deadline)
