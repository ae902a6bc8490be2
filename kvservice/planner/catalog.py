"""What the planner reads about stored variants, and an in-memory catalog.

The planner never touches payloads; it reads variant *metadata* through the small
`VariantCatalog` protocol below. The service backs it with its in-memory index
over RocksDB; tests and benchmarks use `InMemoryCatalog`.

A variant (design card, "Identity and layout") is one stored KV of a chunk computed
behind an ordered prefix of chunk keys; its id is `kvclient.keys.variant_id(chunk_key,
prefix_keys)`. A CRAFT CP-Tree node is just a variant whose prefix is exactly the
chunks before it at the start of the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

from kvclient.types import VariantStats

# Tiers, fastest first (design card, "Service"). The order is the planner's
# tie-break between equally good variants and the default load-speed ranking.
TIERS: tuple[str, ...] = ("gpu", "host", "disk", "remote")
TIER_RANK: dict[str, int] = {t: i for i, t in enumerate(TIERS)}


class InvalidVariant(ValueError):
    """Variant metadata that contradicts itself (stats length vs token count, ...)."""


@dataclass(frozen=True, slots=True)
class VariantInfo:
    """Metadata of one stored variant, as the planner needs it.

    recompute_order: token indices of the chunk sorted by descending
    `stats.token_inter_attention` (ties by index). Cache-Craft §3.3 stores "an ordered
    list of token indices needing recomputation" with each variant, so top-N selection
    (eq. 14) on the request path is a slice. Build it once with `VariantInfo.build`.
    """

    variant_id: str
    chunk_key: str
    prefix_keys: tuple[str, ...]
    token_count: int
    tier: str
    stats: VariantStats
    recompute_order: tuple[int, ...]

    @staticmethod
    def build(
        variant_id: str,
        chunk_key: str,
        prefix_keys: Sequence[str],
        token_count: int,
        tier: str,
        stats: VariantStats,
        recompute_order: tuple[int, ...] | None = None,
    ) -> "VariantInfo":
        """Validate and build; computes `recompute_order` unless one is passed
        (a benchmark may share one order between variants of one chunk)."""
        if token_count < 1:
            raise InvalidVariant(f"variant {variant_id}: token_count {token_count} < 1")
        if tier not in TIER_RANK:
            raise InvalidVariant(f"variant {variant_id}: unknown tier {tier!r}, expected one of {TIERS}")
        tia = stats.token_inter_attention
        if tia and len(tia) != token_count:
            raise InvalidVariant(
                f"variant {variant_id}: {len(tia)} token_inter_attention values for {token_count} tokens"
            )
        if stats.prefix_attention and len(stats.prefix_attention) != len(prefix_keys):
            raise InvalidVariant(
                f"variant {variant_id}: {len(stats.prefix_attention)} prefix_attention values "
                f"for {len(prefix_keys)} prefix chunks"
            )
        if recompute_order is None:
            recompute_order = rank_tokens(tia, token_count)
        elif len(recompute_order) != token_count:
            raise InvalidVariant(f"variant {variant_id}: recompute_order has {len(recompute_order)} entries")
        return VariantInfo(variant_id, chunk_key, tuple(prefix_keys), token_count, tier, stats, recompute_order)


def rank_tokens(token_inter_attention: Sequence[float], token_count: int) -> tuple[int, ...]:
    """Token indices by descending inter-attention (Cache-Craft eq. 14 ranking).

    Without per-token statistics every token is equally contextualized; the order is
    then simply 0..T-1, which still recomputes the right *number* of tokens.
    """
    if not token_inter_attention:
        return tuple(range(token_count))
    return tuple(sorted(range(token_count), key=lambda t: (-token_inter_attention[t], t)))


class VariantCatalog(Protocol):
    """Read side of the variant index, as the planner uses it. Must be cheap (a dict
    lookup): it is called once per chunk of every planned request."""

    def variants_of(self, chunk_key: str) -> Sequence[VariantInfo]:
        """All stored variants of `chunk_key` (any order; empty if none)."""
        ...

    def get(self, variant_id: str) -> VariantInfo | None:
        """The variant with this id, or None if it is not stored."""
        ...


class CatalogListener(Protocol):
    """Hooks a store calls after it changed its metadata (see `Planner`)."""

    def on_put(self, info: VariantInfo) -> None: ...
    def on_move(self, variant_id: str, tier: str) -> None: ...
    def on_evict(self, variant_id: str) -> None: ...


class InMemoryCatalog:
    """Dict-backed `VariantCatalog` for tests and benchmarks.

    Mutations notify the registered listeners (a `Planner`), the way the service's
    store must after each metadata write.
    """

    def __init__(self, listeners: Iterable[CatalogListener] = ()) -> None:
        self._by_id: dict[str, VariantInfo] = {}
        self._by_chunk: dict[str, list[VariantInfo]] = {}
        self.listeners: list[CatalogListener] = list(listeners)

    def variants_of(self, chunk_key: str) -> Sequence[VariantInfo]:
        return self._by_chunk.get(chunk_key, ())

    def get(self, variant_id: str) -> VariantInfo | None:
        return self._by_id.get(variant_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, variant_id: object) -> bool:
        return variant_id in self._by_id

    def put(self, info: VariantInfo, notify: bool = True) -> None:
        """Add or replace a variant."""
        old = self._by_id.get(info.variant_id)
        if old is not None:
            self._by_chunk[old.chunk_key].remove(old)
        self._by_id[info.variant_id] = info
        self._by_chunk.setdefault(info.chunk_key, []).append(info)
        if notify:
            for lst in self.listeners:
                lst.on_put(info)

    def move(self, variant_id: str, tier: str) -> None:
        old = self._by_id[variant_id]
        new = VariantInfo(old.variant_id, old.chunk_key, old.prefix_keys, old.token_count, tier,
                          old.stats, old.recompute_order)
        self.put(new, notify=False)
        for lst in self.listeners:
            lst.on_move(variant_id, tier)

    def evict(self, variant_id: str) -> None:
        old = self._by_id.pop(variant_id)
        lst_ = self._by_chunk[old.chunk_key]
        lst_.remove(old)
        if not lst_:
            del self._by_chunk[old.chunk_key]
        for lst in self.listeners:
            lst.on_evict(variant_id)
