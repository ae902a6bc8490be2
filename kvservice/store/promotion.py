"""Reads and promotion: serve a layer from the fastest tier holding it, and copy
variants up into the fastest tier as a fetch reads them, or after.

A read from a tier with `verify_reads` checks the layer against its checksum; a
failed check (or a payload no tier can read) drops the whole variant and answers
NotFound: a corrupt byte is never served, the engine recomputes. Reads run outside
the store's lock, on variants the caller holds (so no copy of them moves).

A fetch fills the fastest tier's copy as it reads (`Fill`, one per variant, shared by
the fetches that hold it): when the first layer of a variant that the fastest tier
lacks is read from a tier with `verify_reads` (disk, remote), a cache writer opens on
the fastest tier under the admission rule of promotion (`Placement.open_cache_writer`),
and each layer, in order, is read straight into the copy's room, verified there and
served from it: the medium is read once, for the stream and the copy together. When
the fetch closes, a copy holding every layer commits if the variant is still stored;
any other is aborted (its room freed) once no fetch fills it, and the variant falls
back to `promote`, which reads it again, if the fetch ran to its end.

Locks: a fill's lock comes first, the store's second; a fill's lock is never taken
with the store's held. A layer is read into the copy with the fill's lock held, so two
fetches of one variant never write one room; a fill's fetch count and the fills
themselves change under the store's lock.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Iterable

from kvservice.errors import NotFound, Unavailable, transient
from kvservice.index import Variant, eviction_key
from kvservice.store.placement import Placement
from kvservice.store.state import StoreState
from kvservice.tiers.base import TierWriter

log = logging.getLogger("kvcraft.store")


@dataclass(eq=False)
class Fill:
    """The fastest tier's copy of one variant, filled by the reads of the fetches that hold it."""

    fetches: int = 0  # open fetches that joined it
    writer: TierWriter | None = None  # opened when layer 0 is read
    written: int = 0  # layers in the copy, 0 .. written - 1
    taking: bool = True  # False: no writer, or a read failed; the copy takes no more layers
    lock: threading.Lock = field(default_factory=threading.Lock)

    def takes(self, layer: int) -> bool:
        return self.taking and layer == self.written


class Promotion:
    def __init__(self, state: StoreState, placement: Placement) -> None:
        self.s = state
        self.placement = placement
        self._fills: dict[str, Fill] = {}  # variant id -> its fill, while fetches hold the variant

    # -- reads ---------------------------------------------------------------------------
    def read_layer(self, v: Variant, layer: int) -> tuple[memoryview, memoryview]:
        """K and V bytes of one layer of a held variant; the next layer its fill needs
        goes into the fill's copy on the way."""
        fill = self._fills.get(v.variant_id)
        data = None
        if fill is not None and fill.takes(layer):
            with fill.lock:
                if fill.takes(layer):
                    data = self._read_into_fill(v, layer, fill)
        if data is None:
            data, _ = self._read(v, layer)
        kb = v.layout.key_bytes  # type: ignore[union-attr]
        return data[:kb], data[kb:]

    def _read(self, v: Variant, layer: int, into: TierWriter | None = None) -> tuple[memoryview, bool]:
        """One layer from the fastest tier holding it, verified if that tier verifies
        reads. With `into`, read straight into the writer's next room where it has one
        (then True: the layer is in the copy)."""
        s, vid = self.s, v.variant_id
        shape = s.shape(v)
        for tier in s.tiers:
            try:
                data = None
                if into is not None:
                    data = into.fill_layer(lambda room: tier.read_layer_into(vid, layer, shape, room))
                in_copy = data is not None
                if data is None:
                    data = tier.get_layer(vid, layer, shape)
            except KeyError:
                s.counters.misses[tier.name] += 1
                continue
            except OSError as e:
                if transient(e):
                    raise Unavailable(f"variant {vid}: its {tier.name} tier read failed for now ({e}); retry") from None
                self.placement.drop(vid, f"{tier.name} tier read failed: {e}")
                raise NotFound(f"variant {vid}: payload unreadable, dropped; recompute it") from None
            s.counters.hits[tier.name] += 1
            s.counters.layer_reads[tier.name] += 1
            if tier.verify_reads:
                self._verify(v, layer, data)
            return data, in_copy
        self.placement.drop(vid, "no tier holds its payload")
        raise NotFound(f"variant {vid}: payload unreadable, dropped; recompute it")

    def _verify(self, v: Variant, layer: int, data: memoryview) -> None:
        if not v.layer_intact(layer, data):
            self.s.counters.corrupt += 1
            self.placement.drop(v.variant_id, f"layer {layer} failed its checksum")
            raise NotFound(f"variant {v.variant_id} layer {layer} failed its checksum; "
                           "the variant was dropped, recompute it")

    # -- fills: the copy a fetch makes as it reads -----------------------------------------
    def join_fills(self, variants: Iterable[Variant]) -> None:
        """A fetch holding `variants` begins (store lock held): it joins the fill of each
        that has one, and starts one for each that the fastest tier lacks."""
        fastest = self.s.tiers[0]
        for v in _distinct(variants):
            fill = self._fills.get(v.variant_id)
            if fill is None and v.variant_id not in fastest:
                fill = self._fills[v.variant_id] = Fill()
            if fill is not None:
                fill.fetches += 1

    def end_fills(self, variants: Iterable[Variant], *, commit: bool) -> set[str]:
        """A fetch that joined the fills of `variants` ends, its holds not yet released:
        a copy holding every layer commits (`commit`) if the variant is still stored and
        the fastest tier got no copy meanwhile; any other is aborted once no fetch fills
        it. Returns the ids that need no promotion: committed, or still being filled."""
        s = self.s
        settled = set()
        for v in _distinct(variants):
            vid = v.variant_id
            fill = self._fills.get(vid)
            if fill is None:
                continue
            with fill.lock, s.lock:
                fill.fetches -= 1
                done = fill.taking and fill.written == v.num_layers
                if commit and done and s.index.get(vid) is v and vid not in s.tiers[0]:
                    fill.writer.commit()  # type: ignore[union-attr]
                    s.placed(v, 0)
                    s.retier(v)
                    del self._fills[vid]
                    settled.add(vid)
                elif fill.fetches == 0:
                    if fill.writer is not None:
                        fill.writer.abort()
                    del self._fills[vid]
                else:
                    settled.add(vid)  # the last fetch filling it settles it
        return settled

    def _read_into_fill(self, v: Variant, layer: int, fill: Fill) -> memoryview | None:
        """The layer the fill needs next, read into its copy and served from there (fill
        lock held); None, having read nothing, if the copy cannot take it."""
        if fill.writer is None and not self._open_fill(v, fill):
            return None
        writer = fill.writer
        assert writer is not None
        try:
            data, in_copy = self._read(v, layer, writer)
        except BaseException:
            fill.taking = False  # the variant was dropped, or a read failed: never committed
            raise
        if not in_copy:  # a tier outside host memory (the gpu pool): copied in from the read
            try:
                writer.write_layer(data)
            except Exception:  # the copy's fault never fails the read; promote tries again
                log.exception("filling the %s copy of variant %s failed", self.s.tiers[0].name, v.variant_id)
                fill.taking = False
                return data
        fill.written += 1
        return data

    def _open_fill(self, v: Variant, fill: Fill) -> bool:
        """Open the fill's writer as layer 0 is read, if a tier that verifies reads (the
        medium: what a second read costs) serves the variant and the fastest tier admits
        it; else the fill takes nothing. Admission as promotion's, with the variant weighed
        as it will be once the fetch lets go: a fetch's own hold is no claim on the room
        (leased or pinned, it is admitted), and a refusal is counted by the promotion that
        follows (one decision, one count)."""
        s, vid = self.s, v.variant_id
        with s.lock:
            held = s.holders(v)
            if s.index.get(vid) is v and held and held[0] > 0 and s.tiers[held[0]].verify_reads:
                fill.writer = self.placement.open_cache_writer(0, vid, s.shape(v), eviction_key(v),
                                                               v.pinned or v.leases > 0, count_refusal=False)
        fill.taking = fill.writer is not None
        return fill.taking

    # -- promotion -----------------------------------------------------------------------
    def promote(self, variant_ids: Iterable[str], to: int = 0) -> None:
        """Copy variants that tier `to` lacks into it from the fastest lower tier that
        holds them (reads verified): the fast tier gets what requests are about to use.
        Admission follows the cache-tier rule (`Placement.open_cache_writer`)."""
        s = self.s
        todo: list[tuple[Variant, TierWriter, int]] = []
        with s.lock:
            for vid in variant_ids:
                v = s.index.get(vid)
                if v is None or vid in s.tiers[to]:
                    continue
                src = next((i for i in s.holders(v) if i > to), None)
                if src is None:
                    continue
                writer = self.placement.open_cache_writer(to, vid, s.shape(v), eviction_key(v), v.protected)
                if writer is not None:
                    v.holds += 1  # hold while copying, outside the lock
                    todo.append((v, writer, src))
        for v, writer, src in todo:
            try:
                ok = self._copy(v, src, writer)
            finally:
                with s.lock:
                    v.holds -= 1
            with s.lock:
                # A fetch's fill may have committed the copy meanwhile: keep that one.
                if ok and v.variant_id in s.index and v.variant_id not in s.tiers[to]:
                    writer.commit()
                    s.placed(v, to)
                    s.retier(v)
                else:
                    writer.abort()

    def _copy(self, v: Variant, src: int, writer: TierWriter) -> bool:
        """Stream every layer of `v` from tier `src` into `writer`; False (variant
        dropped or gone) if a layer cannot be read or fails its checksum."""
        tier, shape = self.s.tiers[src], self.s.shape(v)
        # The gpu tier's own path: the payload file straight into GPU memory (docs/gpu.md).
        verify = (lambda layer, data: self._verify(v, layer, data)) if tier.verify_reads else None
        reads = self.s.counters.layer_reads
        try:
            if writer.fill_from(tier, v.variant_id, shape, verify):
                reads[tier.name] += v.num_layers
                return True
        except NotFound:  # a layer failed its checksum; the variant was dropped
            return False
        except (KeyError, OSError) as e:
            if not (tier.shared or transient(e)):
                self.placement.drop(v.variant_id, f"{tier.name} tier read failed: {e}")
            return False
        # In place where the writer allows it: the disk tier reads straight into the host
        # slab's room (one copy, no buffer in between), then the room is verified.
        for layer in range(v.num_layers):
            try:
                data = writer.fill_layer(lambda room: tier.read_layer_into(v.variant_id, layer, shape, room))
                copy = data is None
                if copy:
                    data = tier.get_layer(v.variant_id, layer, shape)
            except (KeyError, OSError) as e:
                if not (tier.shared or transient(e)):
                    self.placement.drop(v.variant_id, f"{tier.name} tier read failed: {e}")
                return False
            reads[tier.name] += 1
            if tier.verify_reads:
                try:
                    self._verify(v, layer, data)
                except NotFound:
                    return False
            if copy:
                writer.write_layer(data)
        return True


def _distinct(variants: Iterable[Variant]) -> list[Variant]:
    """Each record once (a fetch may name a variant twice), in order."""
    return list({id(v): v for v in variants}.values())
