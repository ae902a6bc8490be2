"""`cacheblend`: HKVD with gradual filtering (CacheBlend §4.3).

Layer 0 runs every reused token; at each filter layer the rows of the reused chunks still
computed are cut to the share `hkvd_share` of the reused tokens whose K/V, just computed from
the current hidden states, deviate most from the stored (§4.1's KV deviation, both K at the
new positions): r1 > r2 > ... > r. The layer step makes the choice (`step.Choice`): a count
known from the layout, the rows only on the device (eagerly, and inside a captured graph).
Named by the paper's steady-state r (`ratio`) or by its whole `budget`: the share of the
reused tokens' row-layers computed, layer 0 included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine_adapter.policies.base import Prompt, ReusePolicy
from engine_adapter.prompt import Layout
from engine_adapter.selection import LayerView, Selection
from kvcraft.recompute import DEFAULT_BUDGET
from kvkernels.deviation import num_selected


# r1 / r when only r is given (r1 capped at 1): gradual filtering (CacheBlend §4.3) starts
# from a wider set than the steady one and narrows to it. A budget's r is solved with it too.
FIRST_RATIO_OVER_R = 1.5


@dataclass(frozen=True)
class CacheBlend(ReusePolicy):
    """HKVD with gradual filtering. Give `ratio` (the paper's r: the share of reused tokens
    on every layer after the filter layers) or `budget` (the share of the reused tokens'
    row-layers computed in all, layer 0 included); neither: budget DEFAULT_BUDGET."""

    ratio: float | None = None
    first_ratio: float | None = None  # r1 (default min(1, FIRST_RATIO_OVER_R r))
    filter_layers: int = 3  # selections over which r1 falls linearly to r
    budget: float | None = None

    name = "cacheblend"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ratio is not None and self.budget is not None:
            raise ValueError("give cacheblend a ratio or a budget, not both")
        if self.ratio is not None and not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio {self.ratio} outside [0, 1]")
        if self.budget is not None and not 0.0 < self.budget <= 1.0:
            raise ValueError(f"budget {self.budget} outside (0, 1]")
        if self.first_ratio is not None:
            if self.ratio is None:
                raise ValueError("first_ratio needs an explicit ratio")
            if not self.ratio <= self.first_ratio <= 1.0:
                raise ValueError(f"first_ratio {self.first_ratio} must lie in [ratio, 1]")
        if self.filter_layers < 1:
            raise ValueError(f"filter_layers must be >= 1, got {self.filter_layers}")

    def first_rows(self, layout: Layout, s: int) -> Sequence[int]:
        return range(len(layout.segments[s].tokens))  # layer 0: full KV deviation

    def selection(self, prompt: Prompt) -> Selection:
        return Hkvd(self)

    def _scheduled_share(self, j: int, r: float, r1: float) -> float:
        """The gradual-filtering schedule, the one both `hkvd_share` and the budget solve in
        `steady_ratio` use: the share at selection j (0-based, layer j + 1) falls linearly
        from r1 to r over the filter layers, then stays at r (the set no longer changes)."""
        if j >= self.filter_layers - 1:
            return r
        return r1 + (r - r1) * j / (self.filter_layers - 1)

    def steady_ratio(self, num_layers: int) -> float:
        """The r this policy runs with on a model of `num_layers` layers."""
        if self.ratio is not None:
            return self.ratio
        budget = DEFAULT_BUDGET if self.budget is None else self.budget
        k = FIRST_RATIO_OVER_R
        # Row-layers of the reused tokens, in units of one layer: layer 0 runs all (1),
        # selections j = 0..L-2 run share_j(r) with r1 = k r, linear in r while k r <= 1.
        need = budget * num_layers - 1.0
        if need < 0:
            raise ValueError(f"cacheblend budget {budget:.0%} is below layer 0 alone "
                             f"({1 / num_layers:.0%} of a {num_layers}-layer model); "
                             f"give a budget >= {1 / num_layers:.0%} or an explicit ratio")
        per_r = sum(self._scheduled_share(j, 1.0, k) for j in range(num_layers - 1))
        r = need / per_r if per_r else 0.0
        if k * r > 1.0:  # r1 capped at 1: solve the capped schedule by bisection
            lo, hi = 0.0, 1.0
            for _ in range(60):
                mid = (lo + hi) / 2
                got = sum(self._scheduled_share(j, mid, min(1.0, k * mid)) for j in range(num_layers - 1))
                lo, hi = (mid, hi) if got < need else (lo, mid)
            r = lo
        return min(1.0, r)

    def hkvd_share(self, layer: int, num_layers: int) -> float | None:
        """Layer 0 runs every reused token. At layers 1..filter_layers the share falls
        linearly from r1 to r (CacheBlend §4.3 gradual filtering); after that the set
        stays fixed. The paper picks r1 by "the attention deviation on the first layer":
        that is what layer 1's K/V deviation measures. Layer-0 K/V themselves are
        projections of the token embeddings, equal for a chunk computed behind any
        prefix (tested), so a selection on them is blind: one did no better than naive
        reuse up to r = 15% on the trained quality model (docs/quality.md).
        """
        j = layer - 1  # index of this selection
        if not 0 <= j < self.filter_layers:
            return None
        r = self.steady_ratio(num_layers)
        r1 = self.first_ratio if self.first_ratio is not None else min(1.0, FIRST_RATIO_OVER_R * r)
        return self._scheduled_share(j, r, r1)

    def label(self) -> str:
        if self.ratio is not None:
            return f"cacheblend r={self.ratio:.0%}"
        return f"cacheblend budget {DEFAULT_BUDGET if self.budget is None else self.budget:.0%}"


class Hkvd(Selection):
    """The choice at the filter layers: of the candidates (rows of reused chunks still
    computed), keep the share `hkvd_share` of the reused tokens."""

    def __init__(self, policy: CacheBlend) -> None:
        self.policy = policy

    def choice(self, view: LayerView) -> int | None:
        share = self.policy.hkvd_share(view.layer, view.num_layers)
        if share is None or not view.candidates:
            return None
        return num_selected(min(1.0, share * view.reused_tokens / view.candidates), view.candidates)


__all__ = ["CacheBlend", "FIRST_RATIO_OVER_R", "Hkvd"]
