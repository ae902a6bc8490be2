"""The one in-memory index of stored variants, shared by the store and the planner.

`Variant` is the service's record of one stored variant (docs/architecture.md, "Identity" and
"Payload layout"): the planner reads its identity, token count, tier, attention statistics and
recompute order; the store also keeps its payload shape, checksums, fr and holds.
Protobuf stays at the edges: `kvservice.metadata` turns records into RocksDB values,
`kvservice.server` into wire messages.

Compact on purpose (one node holds millions of variants): per-token numbers are arrays of
machine numbers, not tuples of Python objects; tensor specs, layouts and chunk keys are
shared objects (`VariantIndex.intern_*`), not copies per variant.

Thread-safety: the store mutates the index under its lock. Readers that do not take it
(the planner) get immutable snapshots: `variants_of` returns a tuple that is replaced,
never changed, when a chunk gains or loses a variant; a record's `tier` and `fr` may
change under a reader, which the planner tolerates (a stale tier costs a slower plan,
a vanished variant fails its lease and the plan is retried).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Iterator, Sequence

from sortedcontainers import SortedList

from kvcraft.layout import LayerLayout, layer_checksum
from kvcraft.records import VariantStats


class InvalidVariant(ValueError):
    """Variant metadata that contradicts itself (stats length vs token count, ...)."""


@dataclass(frozen=True, slots=True)
class Spec:
    """dtype (kvcraft.v1.DType value) and shape [kv_heads, tokens, head_dim] of K or V."""

    dtype: int
    shape: tuple[int, ...]


@dataclass(slots=True, eq=False)
class Variant:
    """One stored variant. Planner fields first (positional), store fields after.

    recompute_order: token indices by descending `stats.recompute_scores` (the learned
    list, `engine_adapter.learned`) when the variant has them, else by
    `stats.token_inter_attention` (ties by index); Cache-Craft §3.3 keeps "an ordered list of token indices needing
    recomputation" per variant so top-N selection (eq. 14) is a slice. An array of
    small integers, or `range(token_count)` when there are no per-token statistics.
    """

    variant_id: str
    chunk_key: str
    prefix_keys: tuple[str, ...]
    token_count: int
    tier: str  # name of the fastest tier holding the payload, derived from the tiers (`StoreState.retier`)
    stats: VariantStats
    recompute_order: Sequence[int]
    model_id: str = ""
    num_layers: int = 0
    key_spec: Spec | None = None
    value_spec: Spec | None = None
    layout: LayerLayout | None = None
    layer_checksums: Sequence[int] = ()
    fr: float = 0.0  # Cache-Craft §3.3 frequency-reuse score
    last_access_ms: int = 0
    created_ms: int = 0
    pinned: bool = False
    holds: int = 0  # fetch streams, promotions and leases holding it now (not persisted)
    leases: int = 0  # of those, leases (Lookup's `leased`)
    cci: float = -1.0  # Cache-Craft eq. 11 CCI = sigmoid(a / b), filled in by the planner's first use

    @staticmethod
    def build(variant_id: str, chunk_key: str, prefix_keys: Sequence[str], token_count: int, tier: str,
              stats: VariantStats, recompute_order: Sequence[int] | None = None, **store_fields: object) -> "Variant":
        """Validate and build; ranks the tokens unless `recompute_order` is passed (a
        benchmark may share one order between variants of one chunk)."""
        if token_count < 1:
            raise InvalidVariant(f"variant {variant_id}: token_count {token_count} < 1")
        tia = stats.token_inter_attention
        if len(tia) and len(tia) != token_count:
            raise InvalidVariant(
                f"variant {variant_id}: {len(tia)} token_inter_attention values for {token_count} tokens")
        rs = stats.recompute_scores
        if len(rs) and len(rs) != token_count:
            raise InvalidVariant(f"variant {variant_id}: {len(rs)} recompute_scores for {token_count} tokens")
        if len(stats.prefix_attention) and len(stats.prefix_attention) != len(prefix_keys):
            raise InvalidVariant(
                f"variant {variant_id}: {len(stats.prefix_attention)} prefix_attention values "
                f"for {len(prefix_keys)} prefix chunks")
        if recompute_order is None:
            # A learned list outranks eq. 14 (docs/quality.md, token selection).
            recompute_order = rank_tokens(rs if len(rs) else tia, token_count)
        elif len(recompute_order) != token_count:
            raise InvalidVariant(f"variant {variant_id}: recompute_order has {len(recompute_order)} entries")
        return Variant(variant_id, chunk_key, tuple(prefix_keys), token_count, tier, stats, recompute_order,
                       **store_fields)  # type: ignore[arg-type]

    @property
    def size_bytes(self) -> int:
        return self.num_layers * self.layout.layer_bytes if self.layout is not None else 0

    @property
    def protected(self) -> bool:
        """Leased, being fetched or pinned: never moved or deleted (Cache-Craft §3.3)."""
        return self.holds > 0 or self.pinned

    def layer_intact(self, layer: int, data: memoryview) -> bool:
        """Whether `data` (one layer: K bytes, then V) matches the checksum the layer was stored with."""
        kb = self.layout.key_bytes  # type: ignore[union-attr]
        return layer_checksum(data[:kb], data[kb:]) == self.layer_checksums[layer]


EvictionKey = tuple[float, int, int, str]  # (fr, last access ms, created ms, variant id)


def eviction_key(v: Variant) -> EvictionKey:
    """Which variant goes first when a tier is over budget (Cache-Craft §3.3): lowest fr
    (each reuse adds 1/CFO), then least recently accessed, then oldest, then id, so the
    order is total and a brute-force model reproduces it exactly."""
    return (v.fr, v.last_access_ms, v.created_ms, v.variant_id)


def rank_tokens(token_inter_attention: Sequence[float], token_count: int) -> Sequence[int]:
    """Token indices by descending score: inter-attention (Cache-Craft eq. 14 ranking) or
    the learned recompute scores.

    Without per-token statistics every token is equally contextualized; the order is
    then 0..T-1, which still recomputes the right *number* of tokens.
    """
    if not len(token_inter_attention):
        return range(token_count)
    order = sorted(range(token_count), key=lambda t: (-token_inter_attention[t], t))
    return array("H" if token_count < 1 << 16 else "I", order)


class VariantIndex:
    """Variants by id and by chunk key. Mutated by one owner (the store, under its lock)."""

    def __init__(self) -> None:
        self._by_id: dict[str, Variant] = {}
        self._by_chunk: dict[str, tuple[Variant, ...]] = {}
        # Chunk keys in order, for Admin/ListChunks pages (O(log n) per new or removed
        # chunk; a page is a range of it instead of a pass over every key).
        self._chunk_order: SortedList = SortedList()
        self._specs: dict[Spec, Spec] = {}
        self._layouts: dict[LayerLayout, LayerLayout] = {}
        self.pinned = 0  # variants with pinned set (Admin/Stats, every metrics scrape: no walk)

    # -- read side (the planner's VariantCatalog) --------------------------------------
    def variants_of(self, chunk_key: str) -> tuple[Variant, ...]:
        return self._by_chunk.get(chunk_key, ())

    def get(self, variant_id: str) -> Variant | None:
        return self._by_id.get(variant_id)

    def __contains__(self, variant_id: object) -> bool:
        return variant_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Variant]:
        return iter(list(self._by_id.values()))

    def chunk_count(self) -> int:
        return len(self._by_chunk)

    def chunks_over(self, limit: int) -> list[str]:
        """Chunk keys with more than `limit` variants (one pass, no order)."""
        return [k for k, vs in self._by_chunk.items() if len(vs) > limit]

    def chunk_keys_after(self, after: str) -> Iterator[str]:
        """Chunk keys greater than `after`, in order (lazily: do not add or remove
        variants while iterating)."""
        return self._chunk_order.irange(minimum=after, inclusive=(False, False))

    # -- write side ----------------------------------------------------------------------
    def add(self, v: Variant) -> None:
        """Add a variant, or replace the one with its id."""
        old = self._by_id.get(v.variant_id)
        if old is not None:
            self.remove(old.variant_id)
        chunk = self._by_chunk.get(v.chunk_key, ())
        if chunk:
            v.chunk_key = chunk[0].chunk_key  # one string object per chunk key
        else:
            self._chunk_order.add(v.chunk_key)
        self._by_id[v.variant_id] = v
        self._by_chunk[v.chunk_key] = (*chunk, v)
        self.pinned += v.pinned

    def set_pinned(self, v: Variant, pinned: bool) -> None:
        """Pin or unpin a variant of the index."""
        self.pinned += pinned - v.pinned
        v.pinned = pinned

    def remove(self, variant_id: str) -> Variant:
        v = self._by_id.pop(variant_id)
        self.pinned -= v.pinned
        rest = tuple(x for x in self._by_chunk[v.chunk_key] if x is not v)
        if rest:
            self._by_chunk[v.chunk_key] = rest
        else:
            del self._by_chunk[v.chunk_key]
            self._chunk_order.remove(v.chunk_key)
        return v

    def intern_spec(self, spec: Spec) -> Spec:
        return self._specs.setdefault(spec, spec)

    def intern_layout(self, layout: LayerLayout) -> LayerLayout:
        return self._layouts.setdefault(layout, layout)

    def intern_key(self, key: str) -> str:
        """The index's own string object for a stored chunk key (prefix keys share it)."""
        chunk = self._by_chunk.get(key)
        return chunk[0].chunk_key if chunk else key
