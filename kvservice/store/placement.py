"""Which tier holds what: room, demotion, deletion (Cache-Craft §3.3).

Every method runs with the store's lock held.

- A tier that needs room loses its lowest (fr, last access, created, id) unprotected
  variant one tier down: copied into the next tier if no lower tier holds it yet, then
  deleted; leaving the last tier deletes the variant (metadata first, then payloads).
- A cache tier (above the home tier) admits a newcomer only if, among its unprotected
  copies and the newcomer, the newcomer is not the lowest; lower copies go down until
  the newcomer fits. The home tier and those below it always make room, or refuse.
- At most `max_variants_per_chunk` (M) variants per chunk and `max_variants` (N x M) in
  all: a new variant displaces the lowest-fr one.
"""

from __future__ import annotations

import heapq
import logging
from typing import Container, Iterable

from kvservice import failpoints
from kvservice.errors import ResourceExhausted
from kvservice.index import EvictionKey, Variant, eviction_key
from kvservice.store.state import StoreState
from kvservice.tiers.base import PayloadShape, TierFull, TierWriter

log = logging.getLogger("kvcraft.store")


class Placement:
    def __init__(self, state: StoreState, expire_leases) -> None:  # noqa: ANN001 (Leases.expire)
        self.s = state
        self._expire_leases = expire_leases

    def victims(self, pool: Iterable[Variant]) -> list[Variant]:
        return sorted((v for v in pool if not v.protected), key=eviction_key)

    def lowest(self, i: int, skip: Container[str] = ()) -> Variant | None:
        """Tier i's unprotected variant with the lowest eviction key, not in `skip`;
        None if there is none (tier i's eviction order, `StoreState.placed`)."""
        heap, tier, get = self.s.eviction_order[i], self.s.tiers[i], self.s.index.get
        aside = []  # protected or skipped: back in once the victim is found
        found = None
        while heap:
            key = heap[0]
            vid = key[3]
            v = get(vid)
            if v is None or vid not in tier:
                heapq.heappop(heap)  # no longer here
                continue
            now = eviction_key(v)
            if now != key:
                heapq.heapreplace(heap, now)  # reused since: in again at its place
                continue
            if v.protected or vid in skip:
                aside.append(heapq.heappop(heap))
                continue
            found = v
            break
        for entry in aside:
            heapq.heappush(heap, entry)
        return found

    # -- room for a new variant --------------------------------------------------------
    def make_room_for_variant(self, chunk_key: str) -> None:
        """Cache-Craft §3.3: at most M variants per chunk and N x M variants in all."""
        cfg, index = self.s.cfg, self.s.index
        mine = index.variants_of(chunk_key)
        if len(mine) >= cfg.max_variants_per_chunk:
            self._expire_leases()
            victims = self.victims(mine)
            if not victims:
                raise ResourceExhausted(
                    f"chunk {chunk_key} already holds {len(mine)} variants (max_variants_per_chunk) "
                    "and all are leased or pinned")
            self.delete(victims[0].variant_id)
            self.s.counters.evictions += 1
        if len(index) >= cfg.max_variants:
            self._expire_leases()
            victim = self._lowest_of_all()
            if victim is None:
                raise ResourceExhausted(f"store holds max_variants={cfg.max_variants} variants, all leased or pinned")
            self.delete(victim.variant_id)
            self.s.counters.evictions += 1

    def _lowest_of_all(self) -> Variant | None:
        """The unprotected variant with the lowest eviction key in the store, or None."""
        # Every variant is in some tier (one with the same key in each tier holding
        # it): the lowest of the tiers' lowest is the lowest of all.
        lows = [v for i in range(len(self.s.tiers)) if (v := self.lowest(i)) is not None]
        if not lows:
            lows = self.victims(self.s.index)  # before giving up: every variant, sorted
        return min(lows, key=eviction_key) if lows else None

    def open_writer(self, i: int, vid: str, shape: PayloadShape) -> TierWriter:
        """A writer on tier i (the home tier or one below it), making room by demotion;
        ResourceExhausted when every variant there is protected."""
        tier = self.s.tiers[i]
        self._expire_leases()
        tried: set[str] = set()
        while True:
            try:
                return tier.open_writer(vid, shape)
            except TierFull as full:
                victim = self.lowest(i, tried)
                if victim is None:
                    # Before refusing a Store, the order is rebuilt from what the tier holds:
                    # a variant that arrived without an entry costs time, never room.
                    self.s.rebuild_eviction_order((i,))
                    victim = self.lowest(i, tried)
                if victim is None:
                    raise ResourceExhausted(f"{full}, and every variant stored there is leased or pinned") from None
                tried.add(victim.variant_id)
                self.demote(victim, i)

    def open_cache_writer(self, i: int, vid: str, shape: PayloadShape, key: EvictionKey,
                          protected: bool, count_refusal: bool = True) -> TierWriter | None:
        """A writer on cache tier i for a newcomer with eviction key `key`, or None
        when the newcomer is the one that would go down (or can never fit). A refusal
        counts as a move unless `count_refusal` is off (a try that another repeats)."""
        tier = self.s.tiers[i]
        if shape.total_bytes > tier.budget_bytes:
            return None
        self._expire_leases()
        while True:
            try:
                return tier.open_writer(vid, shape)
            except TierFull:
                victim = self.lowest(i, (vid,))
                if victim is None:
                    return None
                if not protected and key < eviction_key(victim):
                    if count_refusal:
                        self.s.counters.moves += 1  # the newcomer is the one that goes down
                    return None
                self.demote(victim, i)

    def fit_budgets(self) -> int:
        """At start: a persistent tier holding more than its budget (the operator lowered
        `disk_budget_bytes` over a data dir) gives up its lowest variants by the eviction order
        until it fits, as a Store would make room, rather than keep the excess until Stores
        come; and so do a chunk of more than `max_variants_per_chunk` variants and a store of
        more than `max_variants` (a Store makes room for one only: the excess would stay). What
        is protected (pinned) stays; the excess left is named. Returns how many went (their
        records' deletes are not synced: the caller's)."""
        index, per_chunk = self.s.index, self.s.cfg.max_variants_per_chunk
        before = self.s.counters.evictions
        crowded = index.chunks_over(per_chunk)
        if crowded:
            victims = [v.variant_id for k in crowded if (held := index.variants_of(k))
                       for v in self.victims(held)[:len(held) - per_chunk]]
            self.delete_many(victims)
            self.s.counters.evictions += len(victims)
            log.warning("%d chunks held more than max_variants_per_chunk=%d variants: %d evicted (lowest fr first)",
                        len(crowded), per_chunk, len(victims))
        n, cap = len(index), self.s.cfg.max_variants
        if n > cap:
            gone = 0
            while len(self.s.index) > cap and (victim := self._lowest_of_all()) is not None:
                self.delete(victim.variant_id)
                self.s.counters.evictions += 1
                gone += 1
            left = len(self.s.index)
            log.warning("the store held %s variants, over max_variants=%s: %d evicted (lowest fr first)%s",
                        f"{n:,}", f"{cap:,}", gone, f"; {left:,} remain, pinned" if left > cap else "")
        for i, tier in enumerate(self.s.tiers):
            used = tier.usage() if tier.persistent else 0
            if used <= tier.budget_bytes:
                continue
            gone = 0
            while tier.usage() > tier.budget_bytes and (victim := self.lowest(i)) is not None:
                self.demote(victim, i)
                gone += 1
            left = tier.usage()
            log.warning("the %s tier held %s bytes, over its budget of %s: %d variants evicted (lowest fr first)%s",
                        tier.name, f"{used:,}", f"{tier.budget_bytes:,}", gone,
                        f"; {left:,} bytes remain, pinned" if left > tier.budget_bytes else "")
        return self.s.counters.evictions - before

    # -- moving down and out -----------------------------------------------------------
    def demote(self, v: Variant, i: int) -> None:
        """Move `v` out of tier i: copy it one tier down unless a lower tier holds it,
        then drop tier i's copy; out of the last tier (or with no copy left below the
        home tier) the variant is deleted."""
        s = self.s
        vid = v.variant_id
        below = [j for j in s.holders(v) if j > i]
        nxt = i + 1
        if nxt < s.home and nxt not in below:
            # One tier down is the next cache tier (gpu -> host) even when the disk holds
            # the variant too: it was hot enough for the faster tier. Admission as for a
            # newcomer (open_cache_writer); refused, the copy simply goes.
            if self._copy_into_cache(v, i, nxt):
                below.append(nxt)
        elif not below and nxt < len(s.tiers):
            below = [nxt] if self._copy_down(v, i, nxt) else []
        if not below:
            self.delete(vid)
            s.counters.evictions += 1
            return
        s.tiers[i].delete(vid)
        s.counters.moves += 1
        s.retier(v)

    def _copy_into_cache(self, v: Variant, src: int, dst: int) -> bool:
        writer = self.open_cache_writer(dst, v.variant_id, self.s.shape(v), eviction_key(v), v.protected)
        return writer is not None and self._fill(v, src, dst, writer)

    def _copy_down(self, v: Variant, src: int, dst: int) -> bool:
        s = self.s
        shape = s.shape(v)
        try:
            writer = self.open_writer(dst, v.variant_id, shape)
        except ResourceExhausted:
            return False
        return self._fill(v, src, dst, writer)

    def _fill(self, v: Variant, src: int, dst: int, writer: TierWriter) -> bool:
        s, shape = self.s, self.s.shape(v)
        tier = s.tiers[src]
        try:
            for layer in range(v.num_layers):
                writer.write_layer(tier.get_layer(v.variant_id, layer, shape))
                s.counters.layer_reads[tier.name] += 1
            writer.commit()
        except (KeyError, OSError) as e:
            writer.abort()
            log.warning("could not move variant %s from %s to %s: %s", v.variant_id, s.tiers[src].name,
                        s.tiers[dst].name, e)
            return False
        s.placed(v, dst)
        return True

    def delete(self, vid: str) -> None:
        self.delete_many([vid])

    def delete_many(self, vids: list[str]) -> None:
        """The metadata first, in one batch, then the payloads: all of it or nothing. A
        metadata write that fails (a full disk) raises before anything else changed, so
        the variants stay stored and readable, and the caller answers for the failure;
        a crash after it leaves payloads without records, which recovery adopts (they
        carry their record): the variants come back whole, never a record without its
        payload. The write is not synced (this runs with the store's lock held, and a
        synced write would hold it through a disk flush; Admin's deletes sync once the
        lock is free): if the machine loses it, the records come back and recovery
        drops them (their payloads are gone), or, where the payloads' renames were lost
        too, the whole variants come back, verified like any payload recovery adopts."""
        if not vids:
            return
        self.s.meta.delete_variants(vids, sync=False)
        failpoints.reach("delete:metadata-deleted")
        self._forget(vids)

    def _forget(self, vids: list[str]) -> None:
        """The variants leave the index and every tier, and the listeners hear of it."""
        s = self.s
        for vid in vids:
            s.index.remove(vid)
            for tier in s.tiers:
                tier.delete(vid)
        for vid in vids:
            for lst in s.listeners:
                lst.on_evict(vid)

    def drop(self, vid: str, why: str) -> None:
        """Delete a variant whose payload cannot be served (unreadable or corrupt)."""
        with self.s.lock:
            if vid in self.s.index:
                log.warning("dropping variant %s: %s", vid, why)
                try:
                    self.delete(vid)
                except Exception as e:  # rocksdict raises plain Exception (a full disk)
                    # It is never served again all the same: its payload goes, and recovery
                    # drops the record left without one.
                    log.warning("the record of dropped variant %s stays until the next start (%s)", vid, e)
                    self._forget([vid])

    def evict_many(self, vs: list[Variant]) -> tuple[int, int]:
        """Admin Evict / Flush: delete the unprotected ones; (evicted, skipped). The
        caller makes it durable (`MetadataDB.sync`) once the store's lock is free."""
        victims = [v.variant_id for v in vs if not v.protected]
        self.delete_many(victims)
        self.s.counters.evictions += len(victims)
        return len(victims), len(vs) - len(victims)
