"""Host-memory tier: payload copies of the hottest variants, in process memory."""

from __future__ import annotations

import threading

from kvservice.tiers.base import Tier


class HostTier(Tier):
    name = "host"

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self._payloads: dict[str, bytes] = {}
        self._used = 0
        self._lock = threading.Lock()

    def put(self, variant_id: str, payload: bytes) -> None:
        with self._lock:
            old = self._payloads.pop(variant_id, None)
            if old is not None:
                self._used -= len(old)
            self._payloads[variant_id] = payload
            self._used += len(payload)

    def read(self, variant_id: str, offset: int, length: int) -> memoryview:
        payload = self._payloads[variant_id]
        return memoryview(payload)[offset : offset + length]

    def delete(self, variant_id: str) -> None:
        with self._lock:
            old = self._payloads.pop(variant_id, None)
            if old is not None:
                self._used -= len(old)

    def usage(self) -> int:
        return self._used

    def __contains__(self, variant_id: str) -> bool:
        return variant_id in self._payloads
