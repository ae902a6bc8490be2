"""One Store stream: the header checked and counted in flight (`begin`), each layer
checked against it as it arrives and written to the home tier's writer (a temporary
file) only, then handed to `kvservice.store.commit`, where the write order is spelled
out (payload, fsync, synced metadata batch, then the copies and the index).

An open stream holds about the layer in hand in memory (`max_inflight_store_bytes`
counts it at INFLIGHT_LAYERS layers). A co-located Store (StoreLocal) takes its layers
from the client's staging area (kvservice.store.staging) instead of gRPC messages: each
copied once into the session's own buffer, written by one `StagedWriter` thread.
"""

from __future__ import annotations

import threading
from array import array
from concurrent.futures import Future

from kvcraft.keys import chunk_key, is_key, variant_id
from kvservice.errors import InvalidArgument, NotFound, ResourceExhausted, check_key
from kvcraft.layout import LayerLayout, LayoutError, layer_checksum, layer_layout
from kvcraft.records import StoreResult
from kvservice.records import StoreHeader
from kvservice.store.commit import commit
from kvservice.store.placement import Placement
from kvservice.store.staging import StagingArea, StagingMaps
from kvservice.store.state import StoreState
from kvservice.tiers.base import Buffer, PayloadShape, TierWriter

# An open Store stream is counted at this many layers of its payload (at most all of
# it) against max_inflight_store_bytes. Layers go to the payload file as they arrive,
# but receiving one costs about three times its size for a moment (grpcio's buffer of
# the message, the Python bytes it builds, the allocator's slack), and the server reads
# one message ahead of the layer being written: measured 2-2.5 layers of RSS per stalled
# stream, about 4 at the peak (tests/service/test_inflight_memory.py; docs/operations.md).
INFLIGHT_LAYERS = 4


def begin(s: StoreState, placement: Placement, h: StoreHeader,
          staging: tuple[str, int, int] | None = None, maps: StagingMaps | None = None) -> "StoreSession":
    """Validate a Store header, count it in flight and open the home tier's writer;
    the session takes the layers. staging: a co-located Store (StoreLocal): the client's
    staging area (staging id, pid, fd), mapped read-only through `maps`."""
    cfg = s.cfg
    if not h.model_id:
        raise InvalidArgument("header.model_id is empty")
    check_key("header.model_id", h.model_id, " (use kvcraft.keys.ModelSpec.fingerprint())")
    tokens = len(h.token_ids)
    if tokens == 0:
        raise InvalidArgument("header.token_ids is empty: a chunk has at least one token")
    if tokens > cfg.max_chunk_tokens:
        raise ResourceExhausted(f"chunk has {tokens} tokens; max_chunk_tokens is {cfg.max_chunk_tokens}")
    if not 1 <= h.num_layers <= cfg.max_layers:
        raise InvalidArgument(f"header.num_layers is {h.num_layers}; expected 1..{cfg.max_layers}")
    for i, p in enumerate(h.prefix_keys):
        if not is_key(p):
            raise InvalidArgument(f"header.prefix_keys[{i}] {p[:40]!r} is not a chunk key")
    try:
        layout = layer_layout(h.key_spec, h.value_spec, tokens)
    except LayoutError as e:
        raise InvalidArgument(str(e)) from None
    if len(h.stats.prefix_attention) not in (0, len(h.prefix_keys)):
        raise InvalidArgument(f"stats.prefix_attention has {len(h.stats.prefix_attention)} values for "
                              f"{len(h.prefix_keys)} prefix keys")
    if len(h.stats.recompute_scores) not in (0, tokens):
        raise InvalidArgument(f"stats.recompute_scores has {len(h.stats.recompute_scores)} values "
                              f"for {tokens} tokens (expected 0 or {tokens})")
    if len(h.stats.token_inter_attention) not in (0, tokens):
        raise InvalidArgument(f"stats.token_inter_attention has {len(h.stats.token_inter_attention)} values "
                              f"for {tokens} tokens")
    shape = PayloadShape(h.num_layers, layout.layer_bytes)
    if shape.total_bytes > cfg.max_variant_bytes:
        raise ResourceExhausted(f"variant payload is {shape.total_bytes} bytes; "
                                f"max_variant_bytes is {cfg.max_variant_bytes}")
    key = chunk_key(h.model_id, h.token_ids)
    vid = variant_id(key, h.prefix_keys)
    charge = min(shape.total_bytes, INFLIGHT_LAYERS * layout.layer_bytes)
    with s.lock:
        if s.inflight_store_bytes + charge > cfg.max_inflight_store_bytes:
            raise ResourceExhausted(
                f"{s.inflight_stores} Store streams in flight hold {s.inflight_store_bytes} bytes; this one "
                f"(layers of {layout.layer_bytes} bytes, counted at {charge}) would pass max_inflight_store_bytes="
                f"{cfg.max_inflight_store_bytes}; retry when others finish")
        s.inflight_store_bytes += charge
        s.inflight_stores += 1
        try:
            if vid in s.index:
                home = None
            else:
                placement.make_room_for_variant(key)
                home = placement.open_writer(s.home, vid, shape)
        except BaseException:
            s.inflight_store_bytes -= charge
            s.inflight_stores -= 1
            raise
    session = StoreSession(s, placement, h, key, vid, layout, home, charge)
    if staging is not None:
        assert maps is not None
        try:
            session.staging = maps.open(*staging, shape.total_bytes)
            session.staging_maps = maps
        except BaseException:
            session.abort()
            raise
    return session


class StoreSession:
    """One Store stream: validates each layer as it arrives and writes it to the tiers."""

    def __init__(self, s: StoreState, placement: Placement, header: StoreHeader, key: str, vid: str,
                 layout: LayerLayout, home: TierWriter | None, charge: int) -> None:
        self._s = s
        self._placement = placement
        self.header = header
        self.chunk_key = key
        self.variant_id = vid
        self.layout = layout
        self.home = home  # None: the variant is already stored, layers are only checked
        self.total_bytes = header.num_layers * layout.layer_bytes
        self.checksums = array("Q")
        self._charge = charge  # counted in StoreState.inflight_store_bytes until the session ends
        self.staging: StagingArea | None = None  # a co-located Store's layers (StoreLocal)
        self.staging_maps: StagingMaps | None = None
        self._bounce: memoryview | None = None  # add_staged's copy of the layer in hand
        self._done = False
        # A cancelled stream's abort may arrive while a worker thread writes a layer.
        self._lock = threading.Lock()

    def add_layer(self, layer: int, key: Buffer, value: Buffer) -> None:
        with self._lock:
            if self._done:
                raise InvalidArgument("the Store stream was aborted")
            n = len(self.checksums)
            if n >= self.header.num_layers:
                raise InvalidArgument(f"layer {layer} is past header.num_layers={self.header.num_layers}")
            if layer != n:
                raise InvalidArgument(f"expected layer {n}, got layer {layer}: layers must arrive in order")
            if len(key) != self.layout.key_bytes:
                raise InvalidArgument(f"layer {n}: key has {len(key)} bytes; key_spec needs {self.layout.key_bytes}")
            if len(value) != self.layout.value_bytes:
                raise InvalidArgument(
                    f"layer {n}: value has {len(value)} bytes; value_spec needs {self.layout.value_bytes}")
            self.checksums.append(layer_checksum(key, value))
            if self.home is not None:
                self.home.write_layer(key, value)

    def add_staged(self, count: int) -> None:
        """Layers up to `count` (exclusive) are in the staging area: copy each one not
        written yet ONCE into this session's own layer buffer, then check, hash and write
        it from there (a co-located Store's add_layer). The client can write its area at
        any time; what is hashed, written and later copied to the host slab (read back
        from the file) is the copy, so they always agree."""
        staging = self.staging
        if staging is None:
            raise InvalidArgument("this Store has no staging area")
        n, lay = len(self.checksums), self.layout
        if not n < count <= self.header.num_layers:
            raise InvalidArgument(f"staged layers {count}: expected {n + 1}..{self.header.num_layers} "
                                  f"({n} staged before, header.num_layers={self.header.num_layers})")
        if self._bounce is None:
            self._bounce = memoryview(bytearray(lay.layer_bytes))
        own, view = self._bounce, staging.view
        for layer in range(n, count):
            base = layer * lay.layer_bytes
            own[:] = view[base : base + lay.layer_bytes]
            self.add_layer(layer, own[: lay.key_bytes], own[lay.key_bytes :])

    def finish(self) -> StoreResult:
        with self._lock:
            if self._done:
                raise InvalidArgument("the Store stream was aborted")
            if len(self.checksums) != self.header.num_layers:
                raise InvalidArgument(f"stream ended after {len(self.checksums)} of "
                                      f"header.num_layers={self.header.num_layers} layers")
            self._done = True
            s = self._s
            ok = False
            try:
                if self.home is None:
                    with s.lock:
                        present = self.variant_id in s.index
                    if not present:
                        raise NotFound(f"variant {self.variant_id} was evicted while being stored again; "
                                       "store it once more")
                    result = self._already_present()
                else:
                    try:
                        result = commit(self._s, self._placement, self) or self._already_present()
                    finally:
                        self.home.abort()  # no-op once committed
                ok = True
            finally:
                self._uncharge()
                self._close_staging(keep=ok)
        return result

    def _uncharge(self) -> None:
        s = self._s
        with s.lock:
            if self._charge:
                s.inflight_store_bytes -= self._charge
                s.inflight_stores -= 1
                self._charge = 0

    def _already_present(self) -> StoreResult:
        v = self._s.index.get(self.variant_id)
        assert v is not None
        return StoreResult(self.chunk_key, self.variant_id, v.size_bytes, already_present=True)

    def abort(self) -> None:
        with self._lock:
            if not self._done:
                self._done = True
                if self.home is not None:
                    self.home.abort()
                self._uncharge()
                self._close_staging()

    def _close_staging(self, keep: bool = False) -> None:
        """Hand the staging area back: kept mapped for the client's next Store after a
        commit, unmapped after a failure."""
        area, self.staging = self.staging, None
        if area is not None:
            self.staging_maps.release(area, keep)


class StagedWriter(threading.Thread):
    """Writes a co-located Store's layers as the client stages them: one thread for the
    whole Store, woken by `stage` (cheap, from the event loop), instead of a worker
    thread hop per StagedLayers message. `done` (a concurrent Future) resolves once every
    layer staged before `end()` is written, or with the error that stopped it."""

    def __init__(self, session: StoreSession) -> None:
        super().__init__(name="kvcraft-store-staged", daemon=True)
        self._session = session
        self._cond = threading.Condition()
        self._staged = 0
        self._ended = False
        self.done: Future = Future()
        self.start()

    def stage(self, count: int) -> None:
        """Layers [0, count) are staged; count must grow, up to num_layers."""
        n = self._session.header.num_layers
        with self._cond:
            if not self._staged < count <= n:
                raise InvalidArgument(f"staged layers {count}: expected {self._staged + 1}..{n} "
                                      f"({self._staged} staged before, header.num_layers={n})")
            self._staged = count
            self._cond.notify()

    def end(self) -> None:
        """No more layers will be staged (the stream ended, or the Store is aborted)."""
        with self._cond:
            self._ended = True
            self._cond.notify()

    def run(self) -> None:
        written = 0
        try:
            while True:
                with self._cond:
                    while self._staged == written and not self._ended:
                        self._cond.wait()
                    target, ended = self._staged, self._ended
                if target > written:
                    self._session.add_staged(target)
                    written = target
                elif ended:
                    break
        except BaseException as e:  # noqa: BLE001 - handed to the handler through `done`
            self.done.set_exception(e.with_traceback(None))
        else:
            self.done.set_result(written)
