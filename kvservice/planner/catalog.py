"""What the planner reads about stored variants.

The planner never touches payloads; it reads variant *metadata* through the small
`VariantCatalog` protocol below. In the service that is the store's own index
(`kvservice.index.VariantIndex`: one index for store and planner); tests and
benchmarks use `InMemoryCatalog`, the same index with put / move / evict hooks.

A variant (docs/architecture.md, "Identity") is one stored KV of a chunk computed
behind an ordered prefix of chunk keys; its id is `kvcraft.keys.variant_id(chunk_key,
prefix_keys)`. A CRAFT CP-Tree node is just a variant whose prefix is exactly the
chunks before it at the start of the prompt.
"""

from __future__ import annotations

from typing import Iterable, Protocol, Sequence

from kvcraft import tiers
from kvservice.index import InvalidVariant, Variant, VariantIndex, rank_tokens

__all__ = ["TIERS", "TIER_RANK", "CatalogListener", "InMemoryCatalog", "InvalidVariant", "Variant",
           "VariantCatalog", "rank_tokens"]

# Every tier name, fastest first: the tie-break between equally good variants. The
# tiers a service runs are the store's (`ChunkStore.tiers`), a subset of these.
TIERS: tuple[str, ...] = tiers.ORDER
TIER_RANK: dict[str, int] = {t: i for i, t in enumerate(TIERS)}


class VariantCatalog(Protocol):
    """Read side of the variant index, as the planner uses it. Must be cheap (a dict
    lookup): it is called once per chunk of every planned request."""

    def variants_of(self, chunk_key: str) -> Sequence[Variant]:
        """All stored variants of `chunk_key` (any order; empty if none)."""
        ...

    def get(self, variant_id: str) -> Variant | None:
        """The variant with this id, or None if it is not stored."""
        ...


class CatalogListener(Protocol):
    """Hooks a store calls after it changed its metadata (see `Planner`)."""

    def on_put(self, info: Variant) -> None: ...
    def on_evict(self, variant_id: str) -> None: ...


class InMemoryCatalog(VariantIndex):
    """A `VariantIndex` that notifies its listeners (a `Planner`) of each change, the
    way the service's store does; for tests and benchmarks."""

    def __init__(self, listeners: Iterable[CatalogListener] = ()) -> None:
        super().__init__()
        self.listeners: list[CatalogListener] = list(listeners)

    def put(self, info: Variant, notify: bool = True) -> None:
        """Add or replace a variant."""
        self.add(info)
        if notify:
            for lst in self.listeners:
                lst.on_put(info)

    def move(self, variant_id: str, tier: str) -> None:
        """The variant now lives in `tier` (the store's `StoreState.retier`); listeners
        read it from the record, no hook."""
        self._by_id[variant_id].tier = tier

    def evict(self, variant_id: str) -> None:
        self.remove(variant_id)
        for lst in self.listeners:
            lst.on_evict(variant_id)
