"""The tier contract: where a variant's payload bytes live.

Tiers are inclusive (docs/storage.md): the disk tier holds every acknowledged variant,
because a write is acknowledged only once durable; faster tiers hold copies of the
hottest ones. Moving a variant "one tier down" drops its copy from the faster tier.

A tier knows nothing of fr, leases or metadata; the store (kvservice.store) decides
what goes where. All methods may be called from several threads, but never twice at
once for the same variant id (the store's holds guarantee that).
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class Tier(ABC):
    name: str

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes

    @abstractmethod
    def read(self, variant_id: str, offset: int, length: int) -> memoryview:
        """`length` bytes of the payload from `offset`. KeyError if absent, OSError on
        I/O failure. No checksum check here: the store verifies."""

    @abstractmethod
    def delete(self, variant_id: str) -> None:
        """Drop the payload; absent is not an error."""

    @abstractmethod
    def usage(self) -> int:
        """Payload bytes held now."""

    @abstractmethod
    def __contains__(self, variant_id: str) -> bool: ...
