"""Reuse policies as small objects: what is reused, which rows run first, HKVD share, focus.

Each policy answers four questions the blend driver asks, and nothing else:

    reused(layout)          which cached chunks are served from stored KV
    first_rows(layout, s)   which token indices of reused chunk s run from layer 0
    hkvd_share(layer, L)    CacheBlend: share of the reused tokens that run `layer`
                            (chosen by KV deviation), None where no selection happens
    focus_window            Cache-Craft Alg. 1 window w (0: off)

full        no reuse: every row computed at every layer (ground truth, and how new
            chunks get their variants + statistics).
prefix      reuse only the leading run of chunks whose variant was computed behind
            exactly the chunks before it (a prefix cache: exact, no recompute).
naive       reuse every cached chunk, recompute nothing but fresh chunks and the question.
cachecraft  the plan's per-chunk top-N token lists (Cache-Craft eq. 14), with
            focused-chunk early termination (Alg. 1, window w) when focus_window > 0.
query       query-aware (engine_adapter/query.py): a question pass with naive reuse measures
            which reused tokens the question reads; the second pass recomputes the most-read
            ones from layer 0, as many as the `budget` leaves (share of the row-layers of the
            reused chunks and the question computed, both passes counted), each with its
            chunk's rows before it (its head) through the first `head_layers` of the layers
            (default half), scored by the reads joined with CacheBlend's signal
            (`deviation`, default 0.5: the question pass also runs layer 0 of every reused
            row and scores each by the deviation of its stored layer-1 K/V; 0: the reads
            alone, 1: the deviation alone). The default.
cacheblend  HKVD with gradual filtering (CacheBlend §4.3): all reused tokens on layer 0,
            then the highest-KV-deviation r1 > r2 > ... > r of them. Named either by the
            paper's steady-state r (`ratio`) or by its whole `budget`: the share of the
            reused tokens' row-layers computed, layer 0 included.

A budget left out is kvcraft.recompute.DEFAULT_BUDGET, the one the planner sizes by too.

`Policy(name, **options)` builds one of them once, from a name (configuration, CLI);
an option the named policy does not have is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Sequence

from engine_adapter.prompt import Layout
from kvcraft.recompute import DEFAULT_BUDGET


@dataclass(frozen=True)
class ReusePolicy:
    """Base of every policy, not one itself (it has no `name`): the four answers, given as
    what most policies share (every cached chunk reused, none of its tokens recomputed, no
    selection, no focus). A policy overrides only the answers it changes."""

    layer_budget_s: float = 0.05  # longest wait for one layer of the reused chunks

    name: ClassVar[str]  # what `Policy` and configuration call it
    focus_window = 0
    asks_question_first = False  # query-aware: blend_prefill runs engine_adapter.query's two passes

    def __post_init__(self) -> None:
        if not self.layer_budget_s >= 0:
            raise ValueError(f"layer_budget_s must be >= 0, got {self.layer_budget_s}")

    def reused(self, layout: Layout) -> list[int]:
        """Indices of the segments whose stored KV this policy reuses."""
        return [s for s, seg in enumerate(layout.segments) if seg.cached]

    def first_rows(self, layout: Layout, s: int) -> Sequence[int]:
        """Token indices inside reused chunk `s` computed from layer 0 on."""
        return ()

    def hkvd_share(self, layer: int, num_layers: int) -> float | None:
        """Share of the reused tokens that run `layer` (attention + MLP), picked by the
        deviation of their `layer` K/V; None: no selection at this layer."""
        return None


@dataclass(frozen=True)
class Full(ReusePolicy):
    name = "full"

    def reused(self, layout: Layout) -> list[int]:
        return []


@dataclass(frozen=True)
class Prefix(ReusePolicy):
    name = "prefix"

    def reused(self, layout: Layout) -> list[int]:
        run = []
        for s, seg in enumerate(layout.segments):
            if not (seg.cached and seg.cached_prefix == layout.keys[:s]):
                break
            run.append(s)
        return run


@dataclass(frozen=True)
class Naive(ReusePolicy):
    """Every cached chunk as stored: the base's answers, unchanged."""

    name = "naive"


@dataclass(frozen=True)
class CacheCraft(ReusePolicy):
    focus_window: int = 0  # Alg. 1 window w; 0 turns early termination off

    name = "cachecraft"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.focus_window < 0:
            raise ValueError(f"focus_window must be >= 0, got {self.focus_window}")

    def first_rows(self, layout: Layout, s: int) -> Sequence[int]:
        return layout.segments[s].recompute  # the plan's top-N list (eq. 14)


@dataclass(frozen=True)
class QueryAware(ReusePolicy):
    """Recompute the reused tokens the question reads (engine_adapter/query.py)."""

    budget: float = DEFAULT_BUDGET  # share of the reused chunks' and question's row-layers, both passes
    heads: int = 1  # 1: the most-read token, then read tokens with their chunk's head (query.most_read); 0: single tokens
    head_layers: float = 0.5  # share of the layers a head row the question did not read is recomputed through
    # Weight of CacheBlend's signal in the picks' score (query.joined_score): 0, the question's
    # reads alone; 1, the deviation of the stored layer-1 K/V alone; between, both, each as a
    # share of its candidates' total. Paid from the budget (layer 0 of every reused row), and
    # only where that is at most DEVIATION_MAX_SHARE of it. 0.5: on held-out MuSiQue with the
    # real model it keeps more of full prefill's answers than either signal alone at the same
    # budget, and on the synthetic tasks it is the reads alone (docs/quality.md).
    deviation: float = 0.5

    name = "query"
    asks_question_first = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.budget <= 1.0:
            raise ValueError(f"budget {self.budget} outside (0, 1]")
        if self.heads not in (0, 1):
            raise ValueError(f"heads must be 0 or 1, got {self.heads}")
        if not 0.0 < self.head_layers <= 1.0:
            raise ValueError(f"head_layers {self.head_layers} outside (0, 1]")
        if not 0.0 <= self.deviation <= 1.0:
            raise ValueError(f"deviation {self.deviation} outside [0, 1]")

    def first_rows(self, layout: Layout, s: int) -> Sequence[int]:
        return layout.segments[s].recompute  # the question pass's picks (query.most_read)

    def label(self) -> str:
        joined = f", KV deviation weighted {self.deviation:g}" if self.deviation else ""
        if not self.heads:
            return f"query budget {self.budget:.0%}, single tokens{joined}"
        return f"query budget {self.budget:.0%}, chunk heads through {self.head_layers:.0%} of the layers{joined}"

    def head_depth(self, num_layers: int) -> int:
        """Layers 0..depth-1 are those a head row runs (at least 2: a row stopped after layer
        0 would repair nothing, its layer-0 K/V being the stored ones)."""
        return min(num_layers, max(2, round(self.head_layers * num_layers)))


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


# Every policy by its name, in the order users see them listed; POLICIES is the names.
_KINDS: dict[str, type[ReusePolicy]] = {
    kind.name: kind for kind in (Full, Prefix, Naive, CacheCraft, CacheBlend, QueryAware)}
POLICIES: tuple[str, ...] = tuple(_KINDS)


def Policy(name: str, **options: object) -> ReusePolicy:  # noqa: N802 - the name users construct by
    """The reuse policy `name` with `options` (its dataclass fields), chosen once."""
    kind = _KINDS.get(name)
    if kind is None:
        raise ValueError(f"unknown policy {name!r}; known: {POLICIES}")
    fields = set(kind.__dataclass_fields__)
    extra = sorted(set(options) - fields)
    if extra:
        raise ValueError(f"policy {name!r} has no option(s) {extra}; it takes {sorted(fields)}")
    return kind(**options)


DEFAULT_POLICY = "query"  # the policy a deployment runs unless it names another (docs/quality.md)


def parse_policy(spec: str) -> ReusePolicy:
    """A policy from its spec: a name, or `name:option=value,...` (numbers), e.g.
    `cacheblend:budget=0.15`. Raises ValueError naming the spec and what is wrong with it."""
    name, colon, rest = spec.strip().partition(":")
    if name not in _KINDS:
        raise ValueError(f"policy spec {spec!r}: unknown policy {name!r} (known: {', '.join(POLICIES)})")
    options: dict[str, int | float] = {}
    for item in rest.split(",") if colon else ():
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq or not key or not value:
            raise ValueError(f"policy spec {spec!r}: option {item.strip()!r} is not key=value")
        if key in options:
            raise ValueError(f"policy spec {spec!r}: option {key!r} given twice")
        options[key] = _number(value, spec, key)
    try:
        return Policy(name, **options)
    except (TypeError, ValueError) as e:
        raise ValueError(f"policy spec {spec!r}: {e}") from None


def _number(value: str, spec: str, key: str) -> int | float:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    raise ValueError(f"policy spec {spec!r}: option {key!r} needs a number, got {value!r}")


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

    @property
    def active(self) -> bool:
        """Still deciding: the driver needs question->chunk attention mass this layer."""
        return self.window > 0 and self.focused is None

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
