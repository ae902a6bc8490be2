"""Leases: a variant named by a lease is held (never moved or deleted) until Release or
the lease's timeout (Cache-Craft §3.3 "pinned while in use"; docs/architecture.md, "Plan").

Holds count every reason a variant must stay put: leases, fetch streams, promotions.
Every method runs with the store's lock held.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Iterable

from kvservice.errors import InvalidArgument
from kvservice.index import Variant
from kvservice.store.state import StoreState


@dataclass
class Lease:
    variant_ids: list[str]
    expires: float  # clock() seconds


class Leases:
    def __init__(self, state: StoreState) -> None:
        self.s = state
        self._leases: dict[str, Lease] = {}

    def take(self, variants: list[Variant], ttl_s: float) -> tuple[str, float]:
        """Hold `variants` for `ttl_s` seconds (0: the configured lease timeout)."""
        if not ttl_s >= 0:
            raise InvalidArgument(f"ttl_s is {ttl_s}; expected >= 0")
        self.expire()
        lease_id = secrets.token_hex(16)
        expires = self.s.clock() + (ttl_s or self.s.cfg.lease_timeout_s)
        self._leases[lease_id] = Lease([v.variant_id for v in variants], expires)
        for v in variants:
            v.holds += 1
        return lease_id, expires

    def release(self, lease_id: str) -> bool:
        self.expire()
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self.unhold(lease.variant_ids)
        return True

    def expire(self) -> None:
        now = self.s.clock()
        for lid in [lid for lid, lease in self._leases.items() if lease.expires <= now]:
            self.unhold(self._leases.pop(lid).variant_ids)

    def unhold(self, vids: Iterable[str]) -> None:
        for vid in vids:
            v = self.s.index.get(vid)
            if v is not None:
                v.holds -= 1

    def leased(self, vid: str) -> bool:
        return any(vid in lease.variant_ids for lease in self._leases.values())

    def __len__(self) -> int:
        return len(self._leases)
