"""Leases: a variant named by a lease is held (never moved or deleted) until Release or
the lease's timeout (Cache-Craft §3.3 "pinned while in use"; docs/architecture.md, "Plan").

Holds count every reason a variant must stay put: leases, fetch streams, promotions.
Every method runs with the store's lock held.
"""

from __future__ import annotations

import heapq
import secrets
from collections import Counter
from dataclasses import dataclass
from kvservice.errors import InvalidArgument
from kvservice.index import Variant
from kvservice.store.state import StoreState


@dataclass
class Lease:
    variant_ids: list[str]
    expires: float  # clock() seconds


class Leases:
    """Every call costs O(log n) in the leases held, amortized, not O(n): a service
    with many leases outstanding (engines that died holding them, until their ttl)
    would otherwise pay a scan of all of them on every Plan, Lease and placement."""

    def __init__(self, state: StoreState) -> None:
        self.s = state
        self._leases: dict[str, Lease] = {}
        # (expires, lease id) of every lease, soonest first; a released lease's entry
        # stays until it comes up (skipped then) or the heap is rebuilt.
        self._by_expiry: list[tuple[float, str]] = []
        self._leased: Counter[str] = Counter()  # variant id -> leases naming it

    def take(self, variants: list[Variant], ttl_s: float) -> tuple[str, float]:
        """Hold `variants` for `ttl_s` seconds (0: the configured lease timeout)."""
        if not ttl_s >= 0:
            raise InvalidArgument(f"ttl_s is {ttl_s}; expected >= 0")
        self.expire()
        lease_id = secrets.token_hex(16)
        expires = self.s.clock() + (ttl_s or self.s.cfg.lease_timeout_s)
        vids = [v.variant_id for v in variants]
        self._leases[lease_id] = Lease(vids, expires)
        heap = self._by_expiry
        if len(heap) > 2 * len(self._leases) + 1024:  # mostly released leases' entries
            heap[:] = [(lease.expires, lid) for lid, lease in self._leases.items()]
            heapq.heapify(heap)
        heapq.heappush(heap, (expires, lease_id))
        self._leased.update(vids)
        for v in variants:
            v.holds += 1
        return lease_id, expires

    def release(self, lease_id: str) -> bool:
        self.expire()
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._end(lease)
        return True

    def expire(self) -> None:
        now = self.s.clock()
        heap = self._by_expiry
        while heap and heap[0][0] <= now:
            lease = self._leases.pop(heapq.heappop(heap)[1], None)
            if lease is not None:
                self._end(lease)

    def _end(self, lease: Lease) -> None:
        leased, get = self._leased, self.s.index.get
        for vid in lease.variant_ids:
            n = leased[vid] - 1
            if n:
                leased[vid] = n
            else:
                del leased[vid]
            v = get(vid)
            if v is not None:
                v.holds -= 1

    def leased(self, vid: str) -> bool:
        self.expire()
        return vid in self._leased

    def __len__(self) -> int:
        return len(self._leases)
