"""Reads and promotion: serve a layer from the fastest tier holding it, and copy
variants up into a faster tier before requests use them.

A read from a tier with `verify_reads` checks the layer against its checksum; a
failed check (or a payload no tier can read) drops the whole variant and answers
NotFound: a corrupt byte is never served, the engine recomputes. Reads run outside
the store's lock, on variants the caller holds (so no copy of them moves).
"""

from __future__ import annotations

from typing import Iterable

from kvservice.errors import NotFound
from kvservice.index import Variant, eviction_key
from kvcraft.layout import layer_checksum
from kvservice.store.placement import Placement
from kvservice.store.state import StoreState
from kvservice.tiers.base import TierWriter


class Promotion:
    def __init__(self, state: StoreState, placement: Placement) -> None:
        self.s = state
        self.placement = placement

    # -- reads ---------------------------------------------------------------------------
    def read_layer(self, v: Variant, layer: int) -> tuple[memoryview, memoryview]:
        """K and V bytes of one layer of a held variant."""
        s = self.s
        shape = s.shape(v)
        for tier in s.tiers:
            try:
                data = tier.get_layer(v.variant_id, layer, shape)
            except KeyError:
                s.counters.misses[tier.name] += 1
                continue
            except OSError as e:
                self.placement.drop(v.variant_id, f"{tier.name} tier read failed: {e}")
                raise NotFound(f"variant {v.variant_id}: payload unreadable, dropped; recompute it") from None
            s.counters.hits[tier.name] += 1
            s.counters.layer_reads[tier.name] += 1
            if tier.verify_reads:
                self._verify(v, layer, data)
            kb = v.layout.key_bytes  # type: ignore[union-attr]
            return data[:kb], data[kb:]
        self.placement.drop(v.variant_id, "no tier holds its payload")
        raise NotFound(f"variant {v.variant_id}: payload unreadable, dropped; recompute it")

    def _verify(self, v: Variant, layer: int, data: memoryview) -> None:
        kb = v.layout.key_bytes  # type: ignore[union-attr]
        if layer_checksum(data[:kb], data[kb:]) != v.layer_checksums[layer]:
            self.s.counters.corrupt += 1
            self.placement.drop(v.variant_id, f"layer {layer} failed its checksum")
            raise NotFound(f"variant {v.variant_id} layer {layer} failed its checksum; "
                           "the variant was dropped, recompute it")

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
                if ok and v.variant_id in s.index:
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
            if not tier.shared:
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
                if not tier.shared:
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
