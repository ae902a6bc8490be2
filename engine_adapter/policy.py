"""Reuse policies: which chunks are reused, and which of their tokens are recomputed per layer.

full        no reuse: every row computed at every layer (ground truth, and how new
            chunks get their variants + statistics).
prefix      reuse only the leading run of chunks whose variant was computed behind
            exactly the chunks before it (a prefix cache: exact, no recompute).
naive       reuse every cached chunk, recompute nothing but fresh chunks and the question.
cachecraft  the plan's per-chunk top-N token lists (Cache-Craft eq. 14), with
            focused-chunk early termination (Alg. 1, window w) when focus_window > 0.
cacheblend  HKVD with gradual filtering (CacheBlend §4.3): all reused tokens on layer 0,
            then the highest-KV-deviation r1 > r2 > ... > r of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

from engine_adapter.prompt import Layout

PolicyName = Literal["full", "prefix", "naive", "cachecraft", "cacheblend"]
POLICIES: tuple[str, ...] = ("full", "prefix", "naive", "cachecraft", "cacheblend")


@dataclass(frozen=True)
class Policy:
    name: PolicyName
    ratio: float = 0.15  # cacheblend: target fraction r of reused tokens recomputed per layer
    first_ratio: float | None = None  # cacheblend: r1 (default min(1, 1.5 r))
    filter_layers: int = 3  # cacheblend: selections over which r1 falls linearly to r
    focus_window: int = 0  # cachecraft: Alg. 1 window w; 0 turns early termination off
    layer_budget_s: float = 0.05  # longest wait for one layer of the reused chunks

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown policy {self.name!r}; known: {POLICIES}")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio {self.ratio} outside [0, 1]")
        if self.first_ratio is not None and not self.ratio <= self.first_ratio <= 1.0:
            raise ValueError(f"first_ratio {self.first_ratio} must lie in [ratio, 1]")
        if self.filter_layers < 1 or self.focus_window < 0 or self.layer_budget_s < 0:
            raise ValueError("filter_layers >= 1, focus_window >= 0 and layer_budget_s >= 0")

    def reused(self, layout: Layout) -> list[int]:
        """Indices of the segments whose stored KV this policy reuses."""
        cached = [s for s, seg in enumerate(layout.segments) if seg.cached]
        if self.name == "full":
            return []
        if self.name == "prefix":
            run = []
            for s, seg in enumerate(layout.segments):
                if not (seg.cached and seg.cached_prefix == layout.keys[:s]):
                    break
                run.append(s)
            return run
        return cached

    def hkvd_ratio(self, layer: int) -> float | None:
        """cacheblend: fraction of the reused tokens that run `layer` (attention + MLP),
        picked by the deviation of their `layer` K/V; None: no selection at this layer.

        Layer 0 runs every reused token. At layers 1..filter_layers the share falls
        linearly from r1 to r (CacheBlend §4.3 gradual filtering); after that the set
        stays fixed. The paper picks r1 by "the attention deviation on the first layer":
        that is what layer 1's K/V deviation measures. Layer-0 K/V themselves are
        projections of the token embeddings, equal for a chunk computed behind any
        prefix (tested), so a selection on them is blind: one did no better than naive
        reuse up to r = 15% on the trained quality model (docs/quality.md).
        """
        j = layer - 1  # index of this selection
        if self.name != "cacheblend" or not 0 <= j < self.filter_layers:
            return None
        r1 = self.first_ratio if self.first_ratio is not None else min(1.0, 1.5 * self.ratio)
        if self.filter_layers == 1:
            return self.ratio
        return r1 + (self.ratio - r1) * j / (self.filter_layers - 1)


def focused_chunks(cinter: Sequence[float]) -> frozenset[int]:
    """Cache-Craft Alg. 1 lines 4-9: the high-valued chunks by cumulative question attention.

    Returns indices into `cinter`. The cut is where the entropy of the normalised gaps
    between sorted scores jumps most (h_{i+1} - h_i, i in [k-2]); with fewer than three
    chunks there is no cut and every chunk is focused.
    """
    k = len(cinter)
    order = sorted(range(k), key=lambda i: -cinter[i])
    if k < 3:
        return frozenset(order)
    s = [cinter[i] for i in order]
    diff = [s[i] - s[i + 1] for i in range(k - 1)]  # line 5
    total = sum(diff)
    if total <= 0:
        return frozenset(order)
    p = [d / total for d in diff]  # line 6
    h, acc = [], 0.0
    for pi in p:  # line 7: cumulative entropy
        acc -= pi * math.log(pi) if pi > 0 else 0.0
        h.append(acc)
    jumps = [h[i + 1] - h[i] for i in range(k - 2)]
    i_star = 1 + max(range(k - 2), key=lambda i: jumps[i])  # line 8, 1-based as in the paper
    return frozenset(order[:i_star])  # line 9


class FocusTracker:
    """Cache-Craft Alg. 1: cumulative question->chunk attention; decides F*, L* once stable."""

    def __init__(self, chunks: Sequence[int], window: int):
        self.chunks = list(chunks)
        self.window = window
        self.cinter = [0.0] * len(self.chunks)
        self.history: list[frozenset[int]] = []
        self.focused: frozenset[int] | None = None  # F*, segment indices
        self.layer: int | None = None  # L*, 0-based

    def update(self, layer: int, inter: Sequence[float]) -> frozenset[int] | None:
        """Add layer `layer`'s inter(C_i, U) (eq. 15); returns F* the first time it is decided."""
        if self.focused is not None or self.window == 0:
            return None
        self.cinter = [c + x for c, x in zip(self.cinter, inter)]
        self.history.append(frozenset(self.chunks[i] for i in focused_chunks(self.cinter)))
        l1 = layer + 1  # the paper counts layers from 1
        if l1 > self.window and len(set(self.history[-self.window:])) == 1:  # line 11
            self.focused, self.layer = self.history[-1], layer
            return self.focused
        return None
