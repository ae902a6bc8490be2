"""`query`, the default policy: ask the question first, then recompute the tokens it reads.

Which tokens of a reused chunk must be recomputed depends on the request: the tokens its
question reads (ProphetKV, "query-aware" selection; Cache-Craft §3.3 measures the same
question-to-chunk attention per chunk, eq. 15, to find the focused chunks). The prefill runs
in two passes over the same stored KV (read from the service once: `source.ReplayLayerSource`):

  1. the question pass (`QuestionPhase`): naive reuse through layers 0..L-2 that computes the
     question alone (fresh chunks, computed once in pass 2, are hidden from its attention)
     and adds up what the question's rows read of each prompt row over layers 1..L-2. Layer
     0 is left out: its K/V are projections of the token embeddings, the same for a chunk
     behind any prefix (docs/adapter.md). The last layer is not run: on the synthetic task's
     dev draw its reads changed no pick that mattered, and it would cost one more layer;
  2. the prefill: the reused rows the question read most run from layer 0 (`picks.most_read`),
     each with its chunk's rows before it where the budget allows (a token recomputed alone
     still reads its chunk's earlier tokens stale; those head rows run only the first
     `head_layers` of the layers, `HeadStop`), fresh chunks in full. Where the prompt has no
     fresh chunk, the question's rows start at layer 1 from pass 1's layer 0 (`selection.Carry`),
     and pass 2 writes its rows over pass 1's merged caches (`reusable_caches`).

The joined selection (`deviation` > 0, the default 0.5) adds CacheBlend's signal (§4.3; its
first check layer is layer 1, since layer-0 K/V do not depend on the prefix): the question
pass also runs layer 0 for every reused row, and at layer 1 measures how far their K/V move
from the stored ones and stops them (a `step.Choice` that keeps none). Each row's score is
then its share of the reads and of the deviation, weighted (`picks.joined_score`). The picks
fill what remains of the budget (a share of the row-layers of the reused chunks and the
question, both passes counted) once the question is paid for (`picks.picks_budget`); where
nothing remains, no question pass runs (naive reuse). Measured in docs/quality.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from engine_adapter.policies.base import Passes, Prompt, ReusePolicy
from engine_adapter.policies.picks import (Picks, QuestionReads, joined_score, most_read, picks_budget,
                                           uses_deviation)
from engine_adapter.prompt import Layout
from engine_adapter.result import BlendResult
from engine_adapter.selection import Carry, LayerView, Pass, Seen, Selection, Wants
from kvcraft.recompute import DEFAULT_BUDGET


@dataclass(frozen=True)
class QueryAware(ReusePolicy):
    """Recompute the reused tokens the question reads (the module docstring)."""

    budget: float = DEFAULT_BUDGET  # share of the reused chunks' and question's row-layers, both passes
    # 1: the most-read token, then read tokens with their chunk's head (picks.most_read); 0: single tokens
    heads: int = 1
    head_layers: float = 0.5  # share of the layers a head row the question did not read is recomputed through
    # Weight of CacheBlend's signal in the picks' score (picks.joined_score): 0, the question's
    # reads alone; 1, the deviation of the stored layer-1 K/V alone; between, both, each as a
    # share of its candidates' total. Paid from the budget (layer 0 of every reused row), and
    # only where that is at most DEVIATION_MAX_SHARE of it. 0.5: on held-out MuSiQue with the
    # real model it keeps more of full prefill's answers than either signal alone at the same
    # budget, and on the synthetic tasks it is the reads alone (docs/quality.md).
    deviation: float = 0.5

    name = "query"

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

    def label(self) -> str:
        joined = f", KV deviation weighted {self.deviation:g}" if self.deviation else ""
        if not self.heads:
            return f"query budget {self.budget:.0%}, single tokens{joined}"
        return f"query budget {self.budget:.0%}, chunk heads through {self.head_layers:.0%} of the layers{joined}"

    def head_depth(self, num_layers: int) -> int:
        """Layers 0..depth-1 are those a head row runs (at least 2: a row stopped after layer
        0 would repair nothing, its layer-0 K/V being the stored ones)."""
        return min(num_layers, max(2, round(self.head_layers * num_layers)))

    def passes(self, prompt: Prompt) -> Passes:
        """The two passes of the module docstring (one, naive reuse, where the budget buys no pick)."""
        lay, L = prompt.layout, prompt.num_layers
        reused_tokens = sum(len(lay.segments[s].tokens) for s in prompt.reused)
        picks = picks_budget(self, lay, reused_tokens, L)
        if picks == 0:  # nothing to spend (not the plan's lists either)
            yield Pass(prompt.reused, prompt.computed(), stats=prompt.stats)
            return
        phase, spec = question_pass(prompt, uses_deviation(self, reused_tokens, picks * L))
        q = phase.outcome((yield spec))
        measured = reused_tokens if q.deviation is not None else 0
        q = dataclasses.replace(q, reads=joined_score(q, self.deviation))
        chosen = most_read(q, lay, picks_budget(self, lay, int(q.live.sum()), L, measured), heads=bool(self.heads),
                           num_layers=L, depth=self.head_depth(L))
        yield prefill_pass(prompt, q, chosen)


class QuestionPhase(Selection):
    """The first pass: naive reuse that runs the question alone and records what it reads
    (`reads`), its rows after layer 0 (`layer0`) and, with `deviation`, every reused row's
    deviation of its stored layer-1 K/V (`deviation`)."""

    def __init__(self, prompt: Prompt, deviation: bool) -> None:
        lay, n = prompt.layout, prompt.layout.n
        self.lay = lay
        reused = [False] * n
        for s in prompt.reused:
            reused[lay.span(s)] = [True] * len(lay.segments[s].tokens)
        asker = set(lay.question_rows())
        self.asking = [r for r in range(n) if not reused[r] and r in asker | {n - 1}]
        # Fresh chunks' rows (computed once, in pass 2) are hidden: placed after every row, so
        # the position-causal mask keeps them out.
        self.hidden = [r for r in range(n - 1) if not reused[r] and r not in asker]
        self.live = [r for r in range(n - 1) if reused[r]]
        self.reads: Tensor | None = None  # [N] (`finish`)
        self.deviation = torch.zeros(n) if deviation else None
        self.layer0: Carry | None = None

    def first(self) -> list[int]:
        """The question's rows; with the deviation measured, every reused row too (layer 0 only)."""
        return self.asking if self.deviation is None else sorted(set(self.asking) | set(self.live))

    def choice(self, view: LayerView) -> int | None:
        # Layer 1 with the deviation on: the reused rows' deviation measured, and none kept
        # (fresh chunks are not seen in this pass: behind one, a reused row's layer 0 reads
        # less context than full prefill's)
        return 0 if self.deviation is not None and view.layer == 1 else None

    def wants(self, view: LayerView) -> Wants:
        return Wants(reads=view.layer > 0)

    def seen(self, view: LayerView, seen: Seen) -> None:
        if seen.deviation is not None:
            self.deviation.index_copy_(0, seen.candidates, seen.deviation)
        if view.layer == 0 and self.lay.segments[-1].question and not self.hidden:
            q = self.lay.rows(len(self.lay.segments) - 1)
            at, kat = torch.searchsorted(seen.rows, q), torch.searchsorted(seen.rows_in, q)
            self.layer0 = Carry(q, seen.h.index_select(0, at), seen.k.index_select(1, kat), seen.v.index_select(1, kat))

    def finish(self, view: LayerView, reads: Tensor | None) -> None:
        self.reads = reads if reads is not None else torch.zeros(self.lay.n)  # (a model of 2 layers reads none)

    def outcome(self, result: BlendResult) -> QuestionReads:
        """What the pass measured, once it ran (`result`)."""
        return QuestionReads(self.reads, live_rows(self.lay, result.reused_segments), result, self.layer0,
                             self.deviation)


def question_pass(prompt: Prompt, deviation: bool) -> tuple[QuestionPhase, Pass]:
    """The question pass of `prompt` (with `deviation`: measuring the reused rows' deviation
    too), and the selection that records what it measures."""
    phase = QuestionPhase(prompt, deviation)
    return phase, Pass(prompt.reused, phase.first(), phase, depth=prompt.num_layers - 1, stats=False,
                       hidden=phase.hidden, whole=True)


class HeadStop(Selection):
    """The second pass's chunk-head rows (`Picks.shallow`) stop after `picks.depth` layers.
    Every chunk here was live through the first pass's layers 0..L-2, so none falls back
    before its head rows stop; one late at layer L-1 catches them up (`merge.Merge.fall_back`)."""

    def __init__(self, picks: Picks) -> None:
        self.shallow, self.depth = picks.shallow.tolist(), picks.depth

    def drop(self, view: LayerView) -> Sequence[int]:
        return self.shallow if view.layer == self.depth - 1 else ()


def prefill_pass(prompt: Prompt, q: QuestionReads, picks: Picks) -> Pass:
    """The second pass: the chunks the question pass kept reused, `picks` recomputed from layer 0
    (their chunk-head rows through `picks.depth` layers), the question's rows from layer 1 where
    the question pass carried them through layer 0, its merged caches written over."""
    lay = prompt.layout
    rows = set(prompt.computed(q.result.reused_segments))
    for s, picked in picks.rows.items():
        rows |= {lay.edges[s] + i for i in picked}
    # With no pick (every chunk stored behind its very prefix), layer 0 would have no row
    # left to run: the question runs it again instead.
    carry = q.layer0 if any(picks.rows.values()) else None
    return Pass(q.result.reused_segments, sorted(rows), HeadStop(picks), stats=prompt.stats, carry=carry,
                caches=reusable_caches(q))


def reusable_caches(q: QuestionReads) -> dict[int, tuple[Tensor, Tensor]]:
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


def live_rows(lay: Layout, segments: Sequence[int]) -> Tensor:
    """[N] bool: the rows of `segments` (the last row never: it is always computed)."""
    live = [False] * lay.n
    for s in segments:
        live[lay.span(s)] = [True] * len(lay.segments[s].tokens)
    live[-1] = False
    return torch.tensor(live)


__all__ = ["HeadStop", "QueryAware", "QuestionPhase", "prefill_pass", "question_pass", "reusable_caches"]
