"""What the store's parts share: config, clock, tiers, index, metadata, lock, listeners."""

from __future__ import annotations

import heapq
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from kvservice.config import Config
from kvservice.index import EvictionKey, Variant, VariantIndex, eviction_key
from kvservice.metadata import MetadataDB
from kvservice.tiers.base import PayloadShape, Tier


log = logging.getLogger("kvcraft.store")


class StoreListener(Protocol):
    """Told of every change in what is stored (the planner keeps its CP-Tree by it).

    Called with the store's lock held, right after the change (for a put: after the
    synced metadata batch), from whichever thread made it. A listener must be quick,
    must not call back into the store (the lock is reentrant, but the store is
    mid-change), and must not block on a lock that a thread calling the store may hold
    while waiting for the store's lock (lock order: store, then listener). A move
    between tiers is not told: `Variant.tier` says where a variant lives (`retier`).
    """

    def on_put(self, variant: Variant) -> None: ...
    def on_evict(self, variant_id: str) -> None: ...


@dataclass
class Counters:
    evictions: int = 0  # variants deleted for space
    moves: int = 0  # copies moved (or kept) one tier down for space
    hits: dict[str, int] = field(default_factory=dict)  # layers read, by tier that served them
    misses: dict[str, int] = field(default_factory=dict)  # layers a tier did not hold when read
    # Layers read from each tier's medium: the fetches' (hits) and the copies' (promotion
    # up, demotion down), so what a tier's reads cost shows however the store moved bytes.
    layer_reads: dict[str, int] = field(default_factory=dict)
    corrupt: int = 0  # layers that failed their checksum


class StoreState:
    """Shared by the parts of one `ChunkStore`; every mutation happens under `lock`."""

    def __init__(self, cfg: Config, tiers: list[Tier], meta: MetadataDB, clock: Callable[[], float],
                 elapsed: Callable[[], float]) -> None:
        """clock: the wall clock (unix seconds: access times kept in the metadata, a lease's end
        as clients are told it); elapsed: a clock no one sets (when leases end, `Leases`)."""
        if not tiers:
            raise ValueError("a store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names repeat: {names}")
        homes = [i for i, t in enumerate(tiers) if t.persistent]
        if not homes:
            raise ValueError(f"no persistent tier among {names}: a Store could never be acknowledged")
        self.cfg = cfg
        self.clock, self.elapsed = clock, elapsed
        self.tiers = tiers
        self.home = homes[0]  # index of the tier a Store must reach before it is acknowledged
        self.meta = meta
        self.index = VariantIndex()
        self.lock = threading.RLock()
        self.access_write_failing = False  # logged once per episode (persist_access)
        self.access_writes_lost = False  # some failed since the start: close writes every variant's
        self.committing: dict[str, threading.Event] = {}  # variant id -> set when its commit ends
        self.inflight_store_bytes = 0  # what open Store sessions are counted at (max_inflight_store_bytes)
        self.inflight_stores = 0
        self.listeners: list[StoreListener] = []
        self.counters = Counters(hits={n: 0 for n in names}, misses={n: 0 for n in names},
                                layer_reads={n: 0 for n in names})
        # Per tier, a min-heap of eviction keys (fr, last access, created, variant id),
        # which `Placement.lowest` reads: one for every variant the tier holds, pushed
        # when it arrives (`placed`). Keys only grow (fr and last access), so an entry is
        # at most its variant's key; entries of variants that left the tier, or whose
        # key grew, are put right when they come up. Finding a victim is O(log n), not
        # a scan.
        self.eviction_order: list[list[EvictionKey]] = [[] for _ in tiers]

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    @staticmethod
    def shape(v: Variant) -> PayloadShape:
        assert v.layout is not None
        return PayloadShape(v.num_layers, v.layout.layer_bytes)

    def holders(self, v: Variant) -> list[int]:
        """Indices of the tiers holding a copy of `v`, fastest first."""
        return [i for i, t in enumerate(self.tiers) if v.variant_id in t]

    def placed(self, v: Variant, tier: int | None = None) -> None:
        """`v` (in the index) arrived in tier `tier` (None: every tier holding it):
        enter it in that tier's eviction order."""
        key = eviction_key(v)
        for i in self.holders(v) if tier is None else (tier,):
            heap = self.eviction_order[i]
            heapq.heappush(heap, key)
            if len(heap) > 2 * len(self.tiers[i]) + 1024:  # mostly entries of variants gone
                self.rebuild_eviction_order((i,))  # the tier holds under half the heap's size

    def rebuild_eviction_order(self, tiers: Iterable[int] | None = None) -> None:
        """Each tier's eviction order from the variants it holds (after recovery, and when
        stale entries pile up): O(the tier's variants), so a small fast tier's costs
        little however many variants the store holds (walking the whole index for it
        takes 1.3-4.4 s at 1M variants, with the store's lock held)."""
        get = self.index.get
        for i in range(len(self.tiers)) if tiers is None else tiers:
            heap = self.eviction_order[i]
            heap[:] = [eviction_key(v) for vid in self.tiers[i].variant_ids() if (v := get(vid)) is not None]
            heapq.heapify(heap)

    def retier(self, v: Variant) -> None:
        """Set `v.tier` to the name of its fastest holder. Which tiers hold a variant is
        recorded once, by the tiers themselves (`Tier.__contains__`); `v.tier` is what
        readers without the store's lock see of it (the planner, on every Plan, and the
        CP-Tree's nodes through the record), derived here only, after every change."""
        held = self.holders(v)
        if held:
            v.tier = self.tiers[held[0]].name

    def persist_access(self, vs: list[Variant]) -> None:
        """fr / last access updates, as access records (`MetadataDB.put_access`): unsynced
        (a crash loses only eviction hints), and best effort: a read must never fail,
        nor leak its holds, because a metadata write did (a full disk); the in-memory
        scores stay right meanwhile, and the store writes them all at close."""
        if not vs:
            return
        try:
            self.meta.put_access(vs)
        except Exception as e:  # rocksdict raises plain Exception for RocksDB statuses
            if not self.access_write_failing:
                log.warning("access-time updates are not persisted (%s); reads go on", e)
            self.access_write_failing = self.access_writes_lost = True
        else:
            self.access_write_failing = False
