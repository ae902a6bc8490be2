"""Shared builders for planner tests."""

from __future__ import annotations

from typing import Sequence

from kvcraft.keys import variant_id
from kvcraft.records import VariantStats
from kvservice.planner import Variant


def key(name: str | int) -> str:
    """A readable fake chunk key: 'C1' -> 'C1' padded to 32 chars."""
    return str(name).ljust(32, "_")


def variant(chunk: str, prefix: Sequence[str], tokens: int = 10, tier: str = "host",
            a: float = 0.5, b: float = 1.0, prefix_attention: Sequence[float] | None = None,
            token_inter: Sequence[float] | None = None, recompute_scores: Sequence[float] = ()) -> Variant:
    prefix = tuple(prefix)
    pa = tuple(prefix_attention) if prefix_attention is not None else tuple(1.0 for _ in prefix)
    if not prefix:
        a = 0.0
    tia = tuple(token_inter) if token_inter is not None else tuple(float(t % 7) for t in range(tokens))
    stats = VariantStats(a=a, b=b, prefix_attention=pa, token_inter_attention=tia,
                         recompute_scores=tuple(recompute_scores))
    return Variant.build(variant_id(chunk, prefix), chunk, prefix, tokens, tier, stats)
