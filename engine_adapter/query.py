"""Query-aware selection: ask the question first, then recompute the tokens it reads.

Which tokens of a reused chunk must be recomputed depends on the request: the tokens its
question reads (ProphetKV, "query-aware" selection; Cache-Craft §3.3 measures the same
question-to-chunk attention per chunk, eq. 15, to find the focused chunks). This prefill
runs in two passes over the same stored KV:

  1. the question pass: naive reuse through layers 0..L-2 that computes the question
     alone (fresh chunks, computed once in pass 2, are left out of its attention) and
     records, per prompt row, the attention the question's rows put on it, summed over
     heads, question rows and layers 1..L-2. Layer 0 is left out of the sum: its K/V are
     projections of the token embeddings, the same for a chunk behind any prefix
     (docs/adapter.md). The last layer is not run: on the synthetic task's dev draw its
     reads changed no pick that mattered, and it would cost the question one more layer;
  2. the prefill: the tokens of the reused chunks the question read most are recomputed
     from layer 0 (`QueryAware.first_rows`: the picks, as a Cache-Craft recompute list),
     each with its chunk's tokens before it where the budget allows (`most_read`: a token
     recomputed alone still reads its chunk's earlier tokens stale; those head tokens run
     only the first half of the layers, `HeadStop`), everything else as in pass 1, fresh
     chunks computed in full. Where the prompt has no fresh chunk, the question's rows
     start at layer 1 from the question pass's layer 0, which is exact for the same
     reason (`driver.Layer0`).

Pass 2 reads the stored layers pass 1 received (`_Replay`), so the service is read once;
a chunk that fell back in pass 1 (a layer late or corrupt) is computed from layer 0 in
pass 2. Where pass 1 computed the question's rows alone, pass 2 writes its rows over pass
1's merged caches rather than merging the stored KV again (`reusable_caches`). The picks
fill what remains of the policy's budget (a share of the row-layers of the reused chunks
and the question, both passes counted) once the question is paid for (`picks_budget`);
where nothing remains, no question pass runs (naive reuse).

The joined selection (`QueryAware.deviation` > 0, the default 0.5) adds CacheBlend's signal (§4.3: the
tokens whose stored K/V deviate most from recomputed ones are those whose cross-attention
matters; its first check layer is layer 1, since layer-0 K/V do not depend on the prefix):
the question pass also runs layer 0 for every reused row, projects their layer-1 K/V, and
drops them (`QuestionPhase.select`); each row's score is then a weighted sum of its
share of the reads and its share of the deviation (`joined_score`), spent as above. The
layer-0 rows are paid from the budget; where they would take more than
DEVIATION_MAX_SHARE of it (shallow models: one layer of every reused row is a large share),
the reads alone are used.

Measured on the real model and the trained synthetic task in docs/quality.md.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from itertools import zip_longest
from typing import Mapping, Sequence

import torch
from torch import Tensor

from engine_adapter.driver import (BlendResult, Layer0, LayerTiming, Selection, Stepped, _Blend, _Rows,
                                   policy_selections, run_blend)
from engine_adapter.llama import LlamaEngine
from engine_adapter.policy import Naive, QueryAware
from engine_adapter.prompt import Layout
from engine_adapter.source import LayerKV, LayerSource
from kvkernels import KeyReads, kv_deviation

# The most of a budget the deviation signal may take (layer 0 of every reused row); beyond
# it the picks would be too few for either signal to pay off.
DEVIATION_MAX_SHARE = 1 / 2


class QuestionPhase(Selection):
    """The first phase: naive reuse that runs the question alone and records what it reads
    (`reads`, whole once the loop ends: `finish`), the question rows after layer 0 (`layer0`)
    and, with `deviation`, the deviation of every reused row's stored layer-1 K/V."""

    def __init__(self, deviation: bool = False) -> None:
        self.measures_deviation = deviation
        self.reads = torch.empty(0)  # [N] attention the question rows put on each row (`prepare`)
        self.deviation: Tensor | None = None  # [N] with `deviation` (`prepare`)
        self.layer0: Layer0 | None = None  # the question rows after layer 0 (phase 2 starts them at 1)
        self.kernel_read = -1  # the last layer whose reads the Triton attention added (`reads_into`)
        self.key_reads: KeyReads | None = None  # the Triton attention's sums (`prepare`)

    def prepare(self, b: _Blend) -> None:
        """Only the question runs here. Rows of fresh chunks (computed once, in phase 2) are
        hidden: placed after every row, so the position-causal mask keeps them out. The
        question's rows, at the end of the prompt, read (nearly) every key: one attention
        call, not runs of rows."""
        self.reads = torch.zeros(b.n)
        self.key_reads = b.key_reads() if b.e.triton else None  # `reads_into`
        self.deviation = torch.zeros(b.n) if self.measures_deviation else None
        self.asker_set = set(b.asker_host)
        asks = self.asker_set | {b.n - 1}
        self.asking = [r for r, reused in enumerate(b.reused_host) if not reused and r in asks]
        self.any_hidden = len(self.asking) < b.n - b.reused_tokens
        hidden = ~b.reused_mask & ~b.asker_mask
        hidden[-1] = False
        b.pos = torch.where(hidden, b.n, b.pos)
        b.causal = b.runs = False

    def first(self, b: _Blend, rows: list[int]) -> list[int]:
        """The question's rows; with the deviation on, every reused row too (layer 0 only)."""
        if self.deviation is None:
            return self.asking
        return sorted(set(self.asking) | {r for r, live in enumerate(b.live_host) if live})

    def compares(self, b: _Blend, layer: int) -> bool:
        return self.deviation is not None and layer == 1

    def select(self, b: _Blend, layer: int, p: _Rows, K: Tensor, V: Tensor) -> tuple[_Rows, Tensor | None]:
        """Layer 1 with the deviation on: record the deviation of the reused rows' recomputed
        K/V (in the merged cache now) from the stored ones (CacheBlend §4.1: |K - K'| + |V - V'|
        summed over heads and dims, both K at this prompt's positions), and stop those rows:
        the question's rows alone run on. (Fresh chunks are not seen in this phase: behind one,
        a reused row's layer 0 reads less context than full prefill's.)"""
        if not self.compares(b, layer) or not p.n_cand:
            return p, None
        at, k_old, v_old = b.stored  # [C] prompt rows, their stored K (RoPE-free) and V (`merged`)
        dev = kv_deviation(K.index_select(1, at), V.index_select(1, at), b.rot.at(at)(k_old), v_old)
        self.deviation.index_copy_(0, at, dev)
        host = b.host_rows(p)
        keep = [i for i, r in enumerate(host) if not b.live_host[r]]
        return b.rows_of([host[i] for i in keep]), torch.tensor(keep, dtype=torch.long)

    def keeps(self, b: _Blend, layer: int, p: _Rows) -> int:
        """None of the candidates (the reused rows) run on after layer 1: the layer may run as
        a static step, which measures their deviation (`measured`) as `select` does."""
        return 0

    def measured(self, b: _Blend, layer: int, p: _Rows, deviation: Tensor) -> None:
        self.deviation.index_copy_(0, p.rows.index_select(0, p.cand), deviation)

    def reads_into(self, b: _Blend, layer: int, p: _Rows) -> KeyReads | None:
        """On the engine's Triton path, the attention adds the question's reads of layer
        1..L-2 up from its own launches (`key_reads`, summed once at `finish`); where rows
        other than the question's run the layer (a chunk caught up after a fallback), the
        plain-torch reads count the question's alone."""
        if self.key_reads is None or layer == 0 or self._askers(b, p).shape[0] != p.rows.shape[0]:
            return None
        self.kernel_read = layer
        return self.key_reads

    def finish(self, b: _Blend) -> None:
        """`reads` becomes what the question read of each row over layers 1..L-2, both ways
        counted: the Triton attention's sums added in (its first n keys are the prompt's,
        `_Blend.key_reads`)."""
        if self.key_reads is not None:
            self.reads = self.reads + self.key_reads.total()[:b.n]
            self.key_reads = None

    def observe(self, b: _Blend, layer: int, out: Stepped) -> None:
        if layer > 0 and self.kernel_read != layer:
            self.reads += self._question_reads(b, layer, out)
        if layer == 0 and b.lay.segments[-1].question and not self.any_hidden:
            q = b.lay.rows(len(b.lay.segments) - 1)
            at = torch.searchsorted(out.rows.rows, q)
            self.layer0 = Layer0(q, out.h.index_select(0, at), out.k.index_select(1, at), out.v.index_select(1, at))

    def _askers(self, b: _Blend, p: _Rows) -> Tensor:
        """Indices into p's rows of the question's rows."""
        return p.memo("question", lambda: torch.tensor(
            [i for i, r in enumerate(b.host_rows(p)) if r in self.asker_set], dtype=torch.long))

    def _question_reads(self, b: _Blend, layer: int, out: Stepped) -> Tensor:
        """[N] this layer's attention probabilities of the question rows, summed over heads
        and rows (plain torch: one [Hq, Rq, N] score matrix, the question is a few rows)."""
        p = out.rows
        at = self._askers(b, p)
        hidden = p.memo("question_mask", lambda: b.pos[None, None, :] > p.rows.index_select(0, at)[None, :, None])
        q = out.q.index_select(1, at).float()  # [Hq, Rq, D]
        Hq, Rq, D = q.shape
        k = b.kv[layer][0].float()  # [Hkv, N, D] merged: stored K of reused rows, this phase's computed rows
        # query heads h*G..h*G+G-1 read kv head h: one batched matmul per kv head, no repeated K
        s = torch.bmm(q.view(k.shape[0], -1, D), k.transpose(1, 2)).view(Hq, Rq, -1) * b.e.scale  # [Hq, Rq, N]
        s = s.masked_fill(hidden, float("-inf"))
        return s.softmax(-1).sum((0, 1))


class _Replay:
    """The first phase's source, then the second's: a layer asked for the first time comes
    from `source` and is kept (`received`, in layer order: the loop asks for each layer
    once, while a chunk is live); asked again, it is handed out as kept, so the service is
    read once. Layers the first phase did not ask for come from `source`."""

    def __init__(self, source: LayerSource, received: Sequence[LayerKV] = ()) -> None:
        self.source = source
        self.received = list(received)

    def wait_layer(self, layer: int, deadline: float) -> LayerKV:
        if layer < len(self.received):
            return self.received[layer]
        got = self.source.wait_layer(layer, deadline)
        if layer == len(self.received):
            self.received.append(got)
        return got

    def close(self) -> None:
        pass  # the caller closes the source


def picks_budget(policy: QueryAware, lay: Layout, reused_tokens: int, num_layers: int, measured: int = 0) -> int:
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
    received: list[LayerKV]  # per layer, the stored KV that arrived
    result: BlendResult  # pass 1 as a prefill (its row counts, timings, fallbacks)
    layer0: Layer0 | None  # the question rows through layer 0
    deviation: Tensor | None = None  # [N] the stored layer-1 K/V's deviation per reused row (None: not measured)


def question_reads(engine: LlamaEngine, lay: Layout, source: LayerSource, reused: Sequence[int],
                   layer_budget_s: float, deviation: bool = False) -> QuestionReads:
    """Pass 1: naive reuse of `reused`, recording what the question reads (and with
    `deviation`, the deviation of the reused rows' stored layer-1 K/V)."""
    phase, replay = QuestionPhase(deviation), _Replay(source)
    loop = _Blend(engine, lay, Naive(layer_budget_s=layer_budget_s), replay, list(reused), stats=False,
                  selections=[phase])
    first = loop.run(False, depth=engine.cfg.num_layers - 1)
    return QuestionReads(phase.reads, loop.live_mask.clone(), replay.received, first, phase.layer0, phase.deviation)


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


def uses_deviation(policy: QueryAware, reused_tokens: int, picks_row_layers: int) -> bool:
    """The deviation signal is measured: weighted, and its cost (layer 0 of every reused row)
    at most DEVIATION_MAX_SHARE (half) of the row-layers the picks could spend without it."""
    return policy.deviation > 0 and 0 < reused_tokens <= DEVIATION_MAX_SHARE * picks_row_layers


@dataclass
class Picks:
    """The reused rows pass 2 recomputes from layer 0."""

    rows: dict[int, tuple[int, ...]]  # per reused segment, its rows (indices in the chunk)
    shallow: Tensor  # prompt rows among them that run only the first `depth` layers (chunk heads)
    depth: int


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
    candidates = q.live.to("cpu", copy=True)  # a copy: q.live stays as pass 1 left it
    for s, seg in enumerate(lay.segments):
        if seg.cached and seg.cached_prefix == lay.keys[:s]:  # stored behind this very prefix: exact
            candidates[lay.span(s)] = False
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


class HeadStop(Selection):
    """The second phase's chunk-head rows (`Picks.shallow`) stop after `picks.depth` layers.
    Every chunk here was live through the first phase's layers 0..L-2, so none falls back
    before its head rows stop; one late at layer L-1 catches them up (`_Blend.fall_back`)."""

    def __init__(self, picks: Picks) -> None:
        self.shallow, self.depth = set(picks.shallow.tolist()), picks.depth

    def next(self, b: _Blend, layer: int, p: _Rows, h: Tensor) -> tuple[_Rows, Tensor]:
        if layer != self.depth - 1 or not self.shallow:
            return p, h
        return b.kept(p, h, [i for i, r in enumerate(b.host_rows(p)) if r not in self.shallow])


def repair(engine: LlamaEngine, lay: Layout, policy: QueryAware, source: LayerSource, live: Sequence[int],
           picks: Picks, all_logits: bool = False, stats: bool = True, carry: Layer0 | None = None,
           caches: Mapping[int, tuple[Tensor, Tensor]] | None = None) -> BlendResult:
    """Pass 2 alone: the blend of `live` with `picks` recomputed from layer 0 (their chunk-head
    rows through `picks.depth` layers). carry: the question rows through layer 0. caches: the
    question pass's merged caches of the layers where it computed the question's rows alone
    (`reusable_caches`), which pass 2 writes its rows over instead of merging them again."""
    segments = list(lay.segments)
    for s, rows in picks.rows.items():
        segments[s] = dataclasses.replace(segments[s], recompute=rows)
    lay2 = dataclasses.replace(lay, segments=tuple(segments))
    return _Blend(engine, lay2, policy, source, list(live), stats, selections=[*policy_selections(), HeadStop(picks)],
                  caches=caches).run(all_logits, carry=carry)


def reusable_caches(q: "QuestionReads") -> dict[int, tuple[Tensor, Tensor]]:
    """The question pass's merged caches pass 2 may write its rows over: layers 1..L-2 where it
    computed the question's rows alone (from layer 2 where it ran every reused row through
    layers 0 and 1 for the deviation), and no chunk fell back (a caught-up chunk's rows were
    computed there too). Pass 2 computes every row the question pass did at those layers, so
    its rows written over such a cache make the cache its own merge would (bit for bit: the
    stored K is rotated by the same tables either way). Layer 0 is merged again (the
    question's carried rows join there), and L-1 the question pass never ran."""
    if q.result.fallbacks:
        return {}
    first = 2 if q.deviation is not None else 1
    return {layer: q.result.kv[layer] for layer in range(first, len(q.result.kv))}


def query_aware_prefill(engine: LlamaEngine, lay: Layout, policy: QueryAware, source: LayerSource,
                        reused: Sequence[int], all_logits: bool = False, stats: bool = True) -> BlendResult:
    """The two passes of the module docstring; one BlendResult whose row counts and timings
    cover both (`computed_share` is what the prefill computed in all)."""
    L = engine.cfg.num_layers
    reused_tokens = sum(len(lay.segments[s].tokens) for s in reused)
    picks = picks_budget(policy, lay, reused_tokens, L)
    if picks == 0:
        naive = Naive(layer_budget_s=policy.layer_budget_s)  # nothing to spend (not the plan's lists either)
        return run_blend(engine, lay, naive, source, reused, all_logits, stats)
    q = question_reads(engine, lay, source, reused, policy.layer_budget_s,
                       deviation=uses_deviation(policy, reused_tokens, picks * L))
    measured = reused_tokens if q.deviation is not None else 0
    q = dataclasses.replace(q, reads=joined_score(q, policy.deviation))
    picks = most_read(q, lay, picks_budget(policy, lay, int(q.live.sum()), L, measured), heads=bool(policy.heads),
                      num_layers=L, depth=policy.head_depth(L))
    # With no pick (every chunk stored behind its very prefix), layer 0 would have no row
    # left to run: the question runs it again instead.
    carry = q.layer0 if any(picks.rows.values()) else None
    res = repair(engine, lay, policy, _Replay(source, q.received), q.result.reused_segments, picks,
                 all_logits, stats, carry, reusable_caches(q))
    # One prefill, two passes: count both.
    first = q.result
    res.computed_rows = [a + b for a, b in zip_longest(res.computed_rows, first.computed_rows, fillvalue=0)]
    res.timings = [LayerTiming(wait_s=a.wait_s + b.wait_s, compute_s=a.compute_s + b.compute_s,
                               rotate_s=a.rotate_s + b.rotate_s, attend_s=a.attend_s + b.attend_s,
                               static=a.static or b.static)
                   for a, b in zip_longest(res.timings, first.timings, fillvalue=LayerTiming(0.0, 0.0))]
    res.fallbacks = first.fallbacks  # pass 2 replays pass 1's arrivals: the same chunks fall back
    return res
