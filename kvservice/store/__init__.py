"""The chunk-cache store: a facade over its named parts. Plain Python, no gRPC and no
protobuf: `kvservice.server` converts at the edge.

  state.py      what the parts share (tiers fastest first, index, metadata, lock, listeners)
  session.py    one Store stream: the header and each layer checked, written to the home tier
  commit.py     a Store's commit, and the write order (payload, fsync, synced metadata batch)
  placement.py  room, demotion one tier down, deletion, the M-per-chunk and N x M caps
  leases.py     leases and holds
  promotion.py  reads from the fastest tier holding a variant (verified), copies up as a fetch
                reads (the fastest tier's copy filled by the same reads) or after
  recovery.py   start-up recovery (the one function that decides what survived a crash)
  sync.py       scale-out: adopt variants other nodes listed, write-through to the remote tier
The store also keeps the sampled-fidelity tallies (`kvservice.fidelity`) in its metadata.
"""

from __future__ import annotations

import secrets
import time
from itertools import islice
from typing import Callable, Iterable, Sequence

from kvcraft.keys import is_key
from kvcraft.records import Ref
from kvservice.config import Config
from kvservice.datadir import DataDirLock
from kvservice.errors import InvalidArgument, NotFound, ResourceExhausted, disk_full
from kvservice.fidelity import FidelityBook
from kvservice.index import Variant, eviction_key
from kvservice.metadata import MetadataDB
from kvservice.planner.variants import fr_increment
from kvservice.records import ChunkSummary, Located, Location, Selector, StoreHeader, StoreStats, TierStats
from kvservice.store.leases import Leases
from kvservice.store.placement import Placement
from kvservice.store.promotion import Promotion
from kvservice.store.recovery import RecoveryReport, recover
from kvservice.store.session import StoreSession, begin
from kvservice.store.staging import StagingMaps
from kvservice.store.state import StoreListener, StoreState
from kvservice.store.sync import attach_cluster
from kvservice.tiers import Tier, build_tiers

__all__ = ["ChunkStore", "RecoveryReport", "StoreListener", "StoreSession"]

FLUSH_BATCH = 1024
LIST_SCAN = 2048  # chunk keys ListChunks reads per hold of the store's lock


class ChunkStore:
    def __init__(self, cfg: Config, *, clock: Callable[[], float] = time.time,
                 elapsed: Callable[[], float] = time.monotonic,
                 tiers: list[Tier] | None = None, repair: bool = False,
                 data_dir_lock: DataDirLock | None = None) -> None:
        """repair: rebuild missing metadata from the payload files (`kvcraft repair`).
        data_dir_lock: the data dir's lock when the caller took it already (repair takes it
        before it moves the metadata aside); the store releases it at `close()`. Without
        it the store takes it, or raises DataDirInUse before it touches anything."""
        self._dir_lock = data_dir_lock or DataDirLock.acquire(cfg.data_path)
        self.cfg = cfg
        # This run of the service: what clients map (shared memory, gpu pool) is tied to
        # it, so a client never reads a restarted service's memory through an old mapping.
        self.instance_id = secrets.token_hex(8)
        # The data dir's lock first (above), then the metadata: the lock makes this process
        # the data dir's one owner before build_tiers removes what earlier runs left in
        # shared memory, and damaged metadata refuses the start before any shared memory
        # exists. Whatever fails later (recovery refusing the metadata's word) closes what
        # was made, the host slab's segment included, and lets go of the lock.
        made: list[Tier] = []
        try:
            meta = MetadataDB(cfg.data_path / "metadata")
        except BaseException:
            self._dir_lock.release()
            raise
        try:
            made = tiers if tiers is not None else build_tiers(cfg, self.instance_id)
            self._s = StoreState(cfg, made, meta, clock, elapsed)
            self.index = self._s.index
            self.tiers = self._s.tiers
            self.listeners: list[StoreListener] = self._s.listeners
            self.counters = self._s.counters
            self._leases = Leases(self._s)
            self._placement = Placement(self._s, self._leases.expire)
            self._promotion = Promotion(self._s, self._placement)
            self._staging_maps = StagingMaps()  # clients' staging areas (co-located Stores)
            self.recovery = recover(self._s, repair=repair)
            with self._s.lock:
                fitted = self._placement.fit_budgets()
            if fitted:
                meta.sync()
            # sampled fidelity and the budgets it sets (PlanningService feeds it)
            self.fidelity = FidelityBook(meta, target=cfg.fidelity_target, sample=cfg.fidelity_sample)
            # Scale-out (docs/scale-out.md): adopt other nodes' variants, write-through.
            self.cluster = attach_cluster(self._s)
        except BaseException:
            meta.close()
            for tier in made:
                tier.close()
            self._dir_lock.release()
            raise

    def close(self) -> None:
        self._staging_maps.close()
        if self.cluster is not None:
            self.cluster.close()
        self.fidelity.close()
        with self._s.lock:
            if self._s.access_writes_lost:
                self._s.persist_access(list(self.index))
            self._s.meta.close()
            for tier in self.tiers:
                tier.close()
        self._dir_lock.release()

    def data_dir_lost(self) -> str:
        """Why this store no longer owns its data dir, "" while it does (DataDirLock.lost)."""
        return self._dir_lock.lost()

    # -- Store ---------------------------------------------------------------------------
    def begin_store(self, header: StoreHeader, staging: tuple[str, int, int] | None = None) -> StoreSession:
        """staging: a co-located Store's (StoreLocal) staging area: (staging id, client pid, fd)."""
        return begin(self._s, self._placement, header, staging, self._staging_maps)

    # -- fetch ---------------------------------------------------------------------------
    def open_fetch(self, refs: Sequence[Ref]) -> list[Variant]:
        """Resolve and hold the variants of a fetch; count the reuse (fr += 1/CFO)."""
        with self._s.lock:
            variants = self._resolve(refs)
            for v in variants:
                v.holds += 1
            self._count_reuse(refs, variants)
            self._promotion.join_fills(variants)
        return variants

    def read_layer(self, v: Variant, layer: int) -> tuple[memoryview, memoryview]:
        """K and V bytes of one layer of a held variant; verified if read from disk. Read
        in order from a slower tier, the layers also fill the fastest tier's copy."""
        if v.variant_id not in self.index:
            raise NotFound(f"variant {v.variant_id} is no longer stored (dropped while fetching); recompute it")
        return self._promotion.read_layer(v, layer)

    def close_fetch(self, variants: Iterable[Variant], *, promote: bool = True) -> None:
        """End a fetch's hold. promote: the fetch ran to its end: the copies its reads
        filled commit, and the variants it could not copy as it read are promoted (read
        again); off (a fetch that stopped early), its copies are aborted and nothing moves."""
        variants = list(variants)
        settled = self._promotion.end_fills(variants, commit=promote)
        with self._s.lock:
            for v in variants:
                v.holds -= 1
        if promote:
            self.promote(v.variant_id for v in variants if v.variant_id not in settled)

    def promote(self, variant_ids: Iterable[str]) -> None:
        self._promotion.promote(variant_ids, to=0)

    def locate(self, refs: Sequence[Ref], ttl_s: float = 0.0) -> Located:
        """Lease the variants, bring them into the mappable tier, say where they are."""
        lease_id, vids, expires = self.take_lease(refs, ttl_s)
        with self._s.lock:
            self._count_reuse(refs, [self.index.get(v) for v in vids])  # type: ignore[misc]
        mappable = next((t for t in self.tiers if t.mappable), None)
        out = []
        if mappable is not None:
            self._promotion.promote(vids, to=self.tiers.index(mappable))
        gpu = next((t for t in self.tiers if t.ipc_pool() is not None), None)  # a CUDA pool (docs/gpu.md)
        with self._s.lock:
            for vid in vids:
                v = self.index.get(vid)  # leased: still stored
                m = mappable.mapping(vid) if mappable is not None else None
                g = (gpu.pool_location(vid) if gpu is not None else None) or (0, 0)
                out.append(Location(v, m.offset if m else 0, m.length if m else 0, *g))  # type: ignore[arg-type]
        pool = gpu.ipc_pool() if gpu is not None else None
        return Located(self.instance_id, mappable.segment if mappable else "", lease_id, expires, out, pool)

    def _count_reuse(self, refs: Sequence[Ref], variants: Sequence[Variant]) -> None:
        now = self._s.now_ms()
        for ref, v in zip(refs, variants):
            v.fr += fr_increment(ref.cfo) if ref.cfo is not None else 1.0
            v.last_access_ms = now
        self._s.persist_access(list(variants))

    def _resolve(self, refs: Sequence[Ref]) -> list[Variant]:
        if not refs:
            raise InvalidArgument("variants is empty: name at least one chunk")
        if len(refs) > self.cfg.max_fetch_variants:
            raise ResourceExhausted(f"{len(refs)} variants requested; max_fetch_variants is {self.cfg.max_fetch_variants}")
        out = []
        for i, ref in enumerate(refs):
            if not is_key(ref.chunk_key):
                raise InvalidArgument(f"variants[{i}].chunk_key {ref.chunk_key[:40]!r} is not a chunk key")
            if ref.cfo is not None and not 0 <= ref.cfo <= 1:
                raise InvalidArgument(f"variants[{i}].cfo is {ref.cfo}; expected [0, 1], or unset if unknown")
            vs = self.index.variants_of(ref.chunk_key)
            if not vs:
                raise NotFound(f"chunk {ref.chunk_key} is not stored")
            if ref.variant_id:
                v = next((v for v in vs if v.variant_id == ref.variant_id), None)
                if v is None:
                    raise NotFound(f"chunk {ref.chunk_key} has no variant {ref.variant_id}")
                out.append(v)
            else:
                alone = [v for v in vs if not v.prefix_keys]
                out.append(alone[0] if alone else max(vs, key=eviction_key))
        return out

    # -- leases and pins -------------------------------------------------------------------
    def take_lease(self, refs: Sequence[Ref], ttl_s: float = 0.0) -> tuple[str, list[str], float]:
        with self._s.lock:
            variants = self._resolve(refs)
            lease_id, expires = self._leases.take(variants, ttl_s)
        return lease_id, [v.variant_id for v in variants], expires

    def lease_variants(self, variant_ids: Sequence[str], ttl_s: float = 0.0) -> tuple[str, float]:
        """Lease variants by id (a plan's choice, already checked): NotFound if one is gone."""
        get = self.index.get
        with self._s.lock:
            variants = [get(vid) for vid in variant_ids]
            if None in variants:
                gone = variant_ids[variants.index(None)]
                raise NotFound(f"variant {gone} is no longer stored")
            return self._leases.take(variants, ttl_s)  # type: ignore[arg-type]

    def release(self, lease_id: str) -> bool:
        with self._s.lock:
            return self._leases.release(lease_id)

    def leased(self, variant_id: str) -> bool:
        with self._s.lock:
            return self._leases.leased(variant_id)

    def set_pinned(self, selector: Selector, pinned: bool) -> int:
        with self._s.lock:
            vs = self._select(selector)
            was = [v.pinned for v in vs]
            for v in vs:
                self.index.set_pinned(v, pinned)
            try:
                self._s.meta.put_variants(vs, sync=False)
            except BaseException:  # not recorded (a full disk): not changed either
                for v, p in zip(vs, was):
                    self.index.set_pinned(v, p)
                raise
        self._s.meta.sync()  # durable before Admin answers; Plans need not wait for the disk
        return len(vs)

    def _select(self, selector: Selector) -> list[Variant]:
        if selector.chunk_key:
            vs = self.index.variants_of(selector.chunk_key)
            if not vs:
                raise NotFound(f"chunk {selector.chunk_key} is not stored")
            return list(vs)
        if selector.variant_id:
            v = self.index.get(selector.variant_id)
            if v is None:
                raise NotFound(f"variant {selector.variant_id} is not stored")
            return [v]
        raise InvalidArgument("selector is empty: give chunk_key or variant_id")

    # -- eviction (Admin) ------------------------------------------------------------------
    def evict(self, selector: Selector) -> tuple[int, int]:
        with self._s.lock:
            self._leases.expire()
            try:
                done = self._placement.evict_many(self._select(selector))
            except Exception as e:
                if disk_full(e):  # the metadata delete failed before any payload went
                    raise ResourceExhausted(
                        f"the disk under the data directory is full ({e}): the eviction cannot be recorded in "
                        "the metadata, so nothing was evicted and every variant stays readable; free space "
                        "on that disk and retry") from None
                raise
        self._s.meta.sync()  # durable before Admin answers, the lock already free
        return done

    def flush(self) -> tuple[int, int]:
        """Every unprotected variant, in batches of FLUSH_BATCH, each one metadata write
        synced once the lock is free: between two, the store's lock is free for Plans,
        fetches and Stores."""
        evicted = skipped = 0
        stored = list(self.index)
        for i in range(0, len(stored), FLUSH_BATCH):
            full: Exception | None = None
            with self._s.lock:
                self._leases.expire()
                batch = [v for v in stored[i:i + FLUSH_BATCH] if self.index.get(v.variant_id) is v]
                try:
                    e, k = self._placement.evict_many(batch)
                except Exception as error:
                    if not disk_full(error):
                        raise
                    full = error  # this batch's metadata delete failed before any payload went
            self._s.meta.sync()  # the batches evicted so far stay evicted
            if full is not None:
                raise ResourceExhausted(
                    f"the disk under the data directory is full ({full}): {evicted} variants were evicted, the "
                    "rest cannot be recorded in the metadata and stay stored and readable; free space on that "
                    "disk and retry")
            evicted, skipped = evicted + e, skipped + k
        return evicted, skipped

    # -- queries ---------------------------------------------------------------------------
    def lookup(self, key: str) -> list[Variant]:
        """The chunk's variants, highest eviction key (most worth keeping) first."""
        return sorted(self.index.variants_of(key), key=eviction_key, reverse=True)

    def get_chunk(self, key: str) -> list[Variant]:
        found = self.lookup(key)
        if not found:
            raise NotFound(f"chunk {key} is not stored")
        return found

    def match_prefix(self, variant_ids: Sequence[str]) -> int:
        """How many leading ids of the chain are stored."""
        n = 0
        for vid in variant_ids:
            if vid not in self.index:
                break
            n += 1
        return n

    def variant_count(self) -> int:
        return len(self.index)

    def stats(self) -> StoreStats:
        """Counts for Admin/Stats and every metrics scrape: O(tiers), nothing walks the
        variants (a walk for the pinned count takes ~0.1 s at 1M variants, holding the
        GIL, so every RPC would wait it out on each scrape)."""
        with self._s.lock:
            self._leases.expire()
            c = self.counters
            tiers = [TierStats(t.name, t.usage(), t.budget_bytes, len(t), c.hits[t.name], c.misses[t.name],
                               c.layer_reads[t.name]) for t in self.tiers]
            cluster = None if self.cluster is None else self.cluster.stats()
            return StoreStats(self.index.chunk_count(), len(self.index), tiers, c.evictions, c.moves,
                              len(self._leases), self.index.pinned, self._s.inflight_store_bytes, self._s.inflight_stores,
                              cluster)

    def list_chunks(self, model_id: str, page_size: int, page_token: str) -> tuple[list[ChunkSummary], str]:
        """One page of chunks in key order after `page_token`; the next page's token ("":
        the last page). Ranges of the index's ordered chunk keys, at most LIST_SCAN at a
        time with the store's lock held (a model filter that matches few chunks reads
        many): at 1M variants a page of 100 takes ~1 ms, against 0.15-0.2 s for a pass
        over every key and 1.6 s for a sort."""
        page_size = page_size or 100
        if page_size > 1000:
            raise InvalidArgument(f"page_size is {page_size}; at most 1000")
        variants_of = self.index.variants_of
        out: list[ChunkSummary] = []
        after = page_token
        scan = page_size + 1  # enough when every chunk matches; more each round a filter skips some
        while True:
            with self._s.lock:
                found = [(k, variants_of(k)) for k in islice(self.index.chunk_keys_after(after), scan)]
            for k, vs in found:
                if model_id and vs[0].model_id != model_id:
                    continue
                if len(out) == page_size:
                    return out, out[-1].chunk_key  # a chunk after this page: there is more
                out.append(ChunkSummary(k, vs[0].model_id, vs[0].token_count, len(vs), sum(v.size_bytes for v in vs)))
            if len(found) < scan:
                return out, ""
            after = found[-1][0]
            scan = min(2 * scan, LIST_SCAN)
