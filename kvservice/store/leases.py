"""Leases: a variant named by a lease is held (never moved or deleted) until Release or
the lease's timeout (Cache-Craft §3.3 "pinned while in use"; docs/architecture.md, "Plan").

Holds count every reason a variant must stay put: leases, fetch streams, promotions.
Every method runs with the store's lock held.
"""

from __future__ import annotations

import heapq
import secrets
from dataclasses import dataclass

from kvservice.errors import InvalidArgument, ResourceExhausted
from kvservice.index import Variant
from kvservice.store.state import StoreState


@dataclass
class Lease:
    variants: list[Variant]  # the records it holds (a variant dropped and stored again is a new one)
    ends: float  # elapsed() seconds


class Leases:
    """Every call costs O(log n) in the leases held, amortized, not O(n): a service
    with many leases outstanding (engines that died holding them, until their ttl)
    would otherwise pay a scan of all of them on every Plan, Lease and placement."""

    def __init__(self, state: StoreState) -> None:
        self.s = state
        self._leases: dict[str, Lease] = {}
        # (ends, lease id) of every lease, soonest first; a released lease's entry
        # stays until it comes up (skipped then) or the heap is rebuilt.
        self._by_expiry: list[tuple[float, str]] = []

    def take(self, variants: list[Variant], ttl_s: float) -> tuple[str, float]:
        """Hold `variants` for `ttl_s` seconds (0: the configured lease timeout)."""
        if not ttl_s >= 0:
            raise InvalidArgument(f"ttl_s is {ttl_s}; expected >= 0")
        self.expire()
        if len(self._leases) >= self.s.cfg.max_leases:
            raise ResourceExhausted(
                f"{len(self._leases)} leases are outstanding; max_leases is {self.s.cfg.max_leases}: "
                "release leases when done with them (Release), or wait for their ttl")
        lease_id = secrets.token_hex(16)
        ttl_s = ttl_s or self.s.cfg.lease_timeout_s
        # It ends ttl_s from now by a clock no one sets: a wall clock stepped forward (NTP, a VM
        # resumed) would end every lease at once under the engines reading those variants, one
        # stepped back would hold them past their ttl. Clients are told the end on the wall clock.
        ends = self.s.elapsed() + ttl_s
        self._leases[lease_id] = Lease(variants, ends)
        heap = self._by_expiry
        if len(heap) > 2 * len(self._leases) + 1024:  # mostly released leases' entries
            heap[:] = [(lease.ends, lid) for lid, lease in self._leases.items()]
            heapq.heapify(heap)
        heapq.heappush(heap, (ends, lease_id))
        for v in variants:
            v.holds += 1
            v.leases += 1
        return lease_id, self.s.clock() + ttl_s

    def release(self, lease_id: str) -> bool:
        self.expire()
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._end(lease)
        return True

    def expire(self) -> None:
        heap, now = self._by_expiry, self.s.elapsed()
        while heap and heap[0][0] <= now:
            lease = self._leases.pop(heapq.heappop(heap)[1], None)
            if lease is not None:
                self._end(lease)

    @staticmethod
    def _end(lease: Lease) -> None:
        for v in lease.variants:
            v.holds -= 1
            v.leases -= 1

    def leased(self, vid: str) -> bool:
        self.expire()
        v = self.s.index.get(vid)
        return v is not None and v.leases > 0

    def __len__(self) -> int:
        return len(self._leases)
