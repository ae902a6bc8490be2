"""Which tokens of reused chunks to recompute, from learned per-variant scores (pure Python).

A stored variant may carry learned recompute scores, one per token
(`kvcraft.records.VariantStats.recompute_scores`): how much of an answer the
token's recompute repaired when a later request computed the chunk in full
(`engine_adapter.learned.learn`). The planner (no torch) and the engine adapter
both spend a recompute budget on them with these functions, so both sides agree.

`allocate` spends one prompt-wide budget on the highest scores of all reused chunks: a
chunk that does not depend on its prefix gets nothing and one that does gets its
binding tokens (Cache-Craft §3.2 sizes a per-chunk N from CCI/CFO, eq. 12-13; here the
learned scores rank tokens across chunks). `per_chunk` is that per-chunk N with the
learned order; `order` ranks one variant's tokens; `merge_scores` accumulates the
scores of several requests that computed the chunk.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

# The default recompute budget: the share of the reused chunks' work spent recomputing
# stale KV, chosen on a validation draw of the quality task (docs/quality.md). One number
# by design, each place in its own unit: the adapter's policies (`QueryAware.budget`,
# `CacheBlend` budget: shares of row-layers), the planner's Cache-Craft alpha (eq. 12,
# `planner.variants.DEFAULT_ALPHA`: CFO <= alpha caps a chunk's share recomputed; the
# service's `cfo_alpha`) and the loading controller's floor r_min (CacheBlend §5,
# `planner.controller.R_MIN`: the ratio it never goes below). Change them together: the
# planner sizes the lists the adapter recomputes, and answer quality was measured at it.
DEFAULT_BUDGET = 0.15


def order(scores: Sequence[float]) -> tuple[int, ...]:
    """Token indices by descending score, ties by index (the variant's recompute order)."""
    return tuple(sorted(range(len(scores)), key=lambda i: (-scores[i], i)))


def allocate(scores: Mapping[int, Sequence[float]], budget: float) -> dict[int, tuple[int, ...]]:
    """Spend a prompt-wide budget on the highest-scoring tokens of all reused chunks.

    scores: chunk (any hashable id, e.g. segment index) -> per-token score; budget: share
    of all their tokens to recompute, in [0, 1], an upper bound: floor(budget * total)
    tokens are chosen. Returns chunk -> sorted token indices (every chunk present,
    possibly empty); ties by chunk order in `scores`, then index. Tokens scored 0 are
    never chosen (their stale KV cost nothing where it was measured).
    """
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"budget {budget} outside [0, 1]")
    total = sum(len(s) for s in scores.values())
    n = math.floor(budget * total + 1e-9)
    ranked = sorted((-float(x), c, i) for c, (_, s) in enumerate(scores.items()) for i, x in enumerate(s)
                    if float(x) > 0.0)
    keys = list(scores)
    out: dict[object, list[int]] = {c: [] for c in keys}
    for _, c, i in ranked[:n]:
        out[keys[c]].append(i)
    return {c: tuple(sorted(v)) for c, v in out.items()}


def per_chunk(scores: Mapping[int, Sequence[float]], fraction: float) -> dict[int, tuple[int, ...]]:
    """The top ceil(fraction |C|) tokens of every chunk (Cache-Craft §3.2.1's N per chunk)."""
    out = {}
    for c, s in scores.items():
        n = math.ceil(fraction * len(s) - 1e-9)
        out[c] = tuple(sorted(order(s)[:n]))
    return out


def merge_scores(old: Sequence[float], new: Sequence[float]) -> tuple[float, ...]:
    """Scores of a chunk observed again: the elementwise maximum (a token whose stale KV
    cost an answer behind any prefix seen so far stays on the list)."""
    if old and len(old) != len(new):
        raise ValueError(f"{len(old)} old scores vs {len(new)} new")
    return tuple(max(float(a), float(b)) for a, b in zip(old, new)) if old else tuple(float(x) for x in new)


__all__ = ["DEFAULT_BUDGET", "order", "allocate", "per_chunk", "merge_scores"]
