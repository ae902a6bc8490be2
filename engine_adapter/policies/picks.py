"""The default policy's picks: which reused rows its second pass recomputes, from what its
question pass measured (`QuestionReads`). Pure functions, tested against brute force.

`picks_budget`: the rows the budget buys once the question is paid for (both passes counted);
`joined_score`: each row's share of the question's reads joined with its share of the stored
layer-1 K/V's deviation (CacheBlend §4.3's signal); `most_read`: the rows, each read row with
its chunk's head before it where the budget allows (docs/quality.md, "the relay")."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from engine_adapter.prompt import Layout
from engine_adapter.result import BlendResult
from engine_adapter.selection import Carry


class Budgeted(Protocol):
    """What the picks read of the default policy's options (`default.QueryAware`)."""

    budget: float  # share of the reused chunks' and question's row-layers, both passes
    deviation: float  # weight of the KV deviation in the picks' score

# The most of a budget the deviation signal may take (layer 0 of every reused row); beyond
# it the picks would be too few for either signal to pay off.
DEVIATION_MAX_SHARE = 1 / 2


def picks_budget(policy: Budgeted, lay: Layout, reused_tokens: int, num_layers: int, measured: int = 0) -> int:
    """Tokens the second pass may recompute from layer 0.

    The budget is a share of the row-layers of the reused chunks and the question: what
    reuse saves on, so a request that brings fresh chunks (computed in full either way) still
    repairs the chunks it reuses. From it the question is paid for, through layers 0..L-2
    in the question pass and 1..L-1 in pass 2 (its layer 0 is the question pass's: layer-0
    K/V do not depend on a chunk's prefix; with fresh chunks, which the question pass does
    not see, pass 2 runs the question's layer 0 again); the rest, counted in rows through
    every layer, is the picks' (`most_read` spends it in row-layers: a head row through half
    the layers costs half). measured: reused rows the question pass ran through layer 0 for
    the deviation signal, paid from the budget too."""
    L = num_layers
    question = len(lay.segments[-1].tokens) if lay.segments[-1].question else 1  # else the last row
    fresh = lay.n - reused_tokens - question
    spent = question * (L - 1) + question * (L if fresh else L - 1) + measured
    return max(0, min(reused_tokens, int((policy.budget * (reused_tokens + question) * L - spent) // L)))


@dataclass
class QuestionReads:
    """Pass 1's outcome."""

    reads: Tensor  # [N] attention the question rows put on each prompt row (layers 1..L-1)
    live: Tensor  # [N] bool: rows still served from stored KV at the end of pass 1
    result: BlendResult  # pass 1 as a prefill (its row counts, timings, fallbacks)
    layer0: Carry | None  # the question rows through layer 0
    deviation: Tensor | None = None  # [N] the stored layer-1 K/V's deviation per reused row (None: not measured)


def joined_score(q: QuestionReads, weight: float) -> Tensor:
    """[N] the picks' score: (1 - weight) x each live row's share of the live rows' reads +
    weight x its share of their deviation (each signal summing to 1 over the candidates, so
    the weight is the split between them whatever their units)."""
    if q.deviation is None or weight <= 0:
        return q.reads
    live = q.live.float()

    def share(x: Tensor) -> Tensor:
        x = x * live
        total = x.sum()
        return x / total if float(total) > 0 else x

    return (1 - weight) * share(q.reads) + weight * share(q.deviation)


def uses_deviation(policy: Budgeted, reused_tokens: int, picks_row_layers: int) -> bool:
    """The deviation signal is measured: weighted, and its cost (layer 0 of every reused row)
    at most DEVIATION_MAX_SHARE (half) of the row-layers the picks could spend without it."""
    return policy.deviation > 0 and 0 < reused_tokens <= DEVIATION_MAX_SHARE * picks_row_layers


@dataclass
class Picks:
    """The reused rows pass 2 recomputes from layer 0."""

    rows: dict[int, tuple[int, ...]]  # per reused segment, its rows (indices in the chunk)
    shallow: Tensor  # prompt rows among them that run only the first `depth` layers (chunk heads)
    depth: int


def candidate_rows(q: QuestionReads, lay: Layout) -> Tensor:
    """[N] bool, on the CPU: the rows a pick may recompute, those still live after pass 1 but
    not of a chunk stored behind exactly the chunks before it here (exact: nothing to repair)."""
    candidates = q.live.to("cpu", copy=True)  # a copy: q.live stays as pass 1 left it
    for s, seg in enumerate(lay.segments):
        if seg.cached and seg.cached_prefix == lay.keys[:s]:  # stored behind this very prefix: exact
            candidates[lay.span(s)] = False
    return candidates


def most_read(q: QuestionReads, lay: Layout, n: int, heads: bool = False,
              num_layers: int = 1, depth: int | None = None) -> Picks:
    """What `n` rows recomputed through every layer buy, as recompute lists per reused segment.
    Chunks whose stored variant was computed behind exactly the chunks before them here
    (an instruction at the start, a prefix-cache hit) are exact: nothing of them is picked.

    heads=False: the `n` live rows the question read most. heads (the default policy's): the
    most-read row first; then, in order of reads, each read row with every row of its chunk
    before it (the chunk's head up to it), where the rows not yet picked fit in what is left;
    then single rows in order of reads with what remains. A row's KV depends on its chunk's
    earlier rows, which a recomputed row alone still reads stale (docs/quality.md, "the
    relay"); the most-read row alone repairs a chunk whose binding is that one token. A head
    row the question did not read runs only layers 0..depth-1 of the model's `num_layers`
    (default: every layer) and costs depth/L of a row: the relay its chunk's later rows read
    is in its lower layers' K/V."""
    L = num_layers
    depth = L if depth is None else depth
    # The picks are a loop over rows: on the CPU (two reads of the device, not one per row).
    candidates = candidate_rows(q, lay)
    score = q.reads.cpu().masked_fill(~candidates, -1.0)
    n = min(n, int(candidates.sum()))
    shallow: list[int] = []
    if heads:
        picked, shallow = _heads(score, lay, n * L, L, depth)
        if depth >= L:
            shallow = []  # every picked row runs every layer
    else:
        picked = sorted(score.topk(n).indices.tolist()) if n else []
    rows = {}
    for s in q.result.reused_segments:
        lo, hi = lay.edges[s], lay.edges[s + 1]
        rows[s] = tuple(i - lo for i in picked[bisect.bisect_left(picked, lo):bisect.bisect_left(picked, hi)])
    return Picks(rows, torch.tensor(shallow, dtype=torch.long, device=q.live.device), depth)


def _heads(score: Tensor, lay: Layout, budget: int, L: int, depth: int) -> tuple[list[int], list[int]]:
    """`most_read(heads=True)`'s rows within `budget` row-layers (a row through every layer
    costs L, a head row the question did not read `depth`): all of them, and the head rows,
    sorted. `score` [N] on the CPU, -1 for rows that are not candidates."""
    score = torch.where(score >= 0, score, -1.0)  # (a NaN too: not a candidate)
    order = score.argsort(descending=True, stable=True)[:int((score >= 0).sum())].tolist()  # candidates first
    deep = set(order[:min(1, budget // L)])  # rows through every layer
    deep_sorted = sorted(deep)  # the same, to count those in a range without a walk over it
    shallow: set[int] = set()  # head rows through layers 0..depth-1
    left = budget - L * len(deep)
    edges = lay.edges
    seg_of = torch.repeat_interleave(torch.arange(len(edges) - 1),
                                     torch.tensor([b - a for a, b in zip(edges, edges[1:])])).tolist()  # row -> segment
    head_end = list(edges[:-1])  # segment -> end of its picked head (exclusive)
    # The cheapest step that changes the picks: a head row the question reads taken through
    # every layer (L - depth), one more head row (depth) or a row alone (L). Below it nothing
    # more fits, so the walks stop there (the rows they would still visit change nothing).
    least = min(depth, L - depth) if depth < L else 0

    def go_deep(i: int) -> None:
        deep.add(i)
        bisect.insort(deep_sorted, i)

    for i in order:
        if left < least:
            break
        s = seg_of[i]
        end = head_end[s]
        if i < end:  # read, in a head picked already: through every layer where it fits
            if i in shallow and left >= L - depth:
                shallow.discard(i)
                go_deep(i)
                left -= L - depth
            continue
        # The rows of i's head not yet picked: end..i-1 less the deep ones among them.
        unpicked = (i - end) - (bisect.bisect_left(deep_sorted, i) - bisect.bisect_left(deep_sorted, end))
        cost = depth * unpicked + (0 if i in deep else L)
        if cost <= left:
            left -= cost
            shallow.update(range(end, i))
            shallow.difference_update(deep_sorted[bisect.bisect_left(deep_sorted, end):bisect.bisect_left(deep_sorted, i)])
            go_deep(i)
            head_end[s] = i + 1
    for i in order:  # single rows with what remains
        if left < least:
            break
        if i in deep:
            continue
        cost = L - depth if i in shallow else L
        if cost > left:
            continue
        shallow.discard(i)
        go_deep(i)
        left -= cost
    return sorted(deep | shallow), sorted(shallow)


__all__ = ["DEVIATION_MAX_SHARE", "Picks", "QuestionReads", "candidate_rows", "joined_score", "most_read", "picks_budget",
           "uses_deviation"]
