"""The statistics of the chunks a prefill computes fresh (Cache-Craft §3.1,
`kvcraft.records.VariantStats`), observed from the layer steps: each fresh chunk's K/V per
layer (RoPE-free: the variant to store) and the attention mass its rows put on each segment.

Every row of a fresh chunk is computed at every layer, so the mass of those rows, which the
attention returns per segment where asked (`attention.attend`'s `mass_rows`), gives per token
and segment eq. 3's inter-attention (summed over layers) and per chunk eq. 4's intra-attention;
eq. 9-10 average them into a and b, eq. 14's per-token totals rank a later reuse's recompute
list.

The mass is the statistics' cost (its probabilities in fp32: at 2,200 tokens on a 2-core CPU
half as much again as the prefill itself), and nothing before the first token reads it: on
the CPU a layer whose mass only the statistics need hands over its rotated queries of the
fresh rows and its cache instead (`later`), and the mass is computed when the statistics are
first read (`FreshChunk.stats`: by the store-back, on its own thread), layer by layer, with
the same operations in the same order as in the pass (the same numbers). On a GPU the
attention kernel returns the mass in its own launch: it stays in the pass."""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch
from torch import Tensor

from engine_adapter.prompt import Layout
from engine_adapter.result import FreshChunk
from kvcraft.records import VariantStats
from kvkernels import attention_mass


class Later(NamedTuple):
    """What a layer's mass of the fresh rows is computed from, after the pass."""

    q: Tensor  # [Hq, M, D] the fresh rows' queries, rotated
    q_pos: Tensor  # [M]
    K: Tensor  # [Hkv, T, D] the layer's cache, rotated
    k_pos: Tensor  # [T]
    scale: float


class FreshStats:
    """The fresh chunks `fresh` (segment indices) of a prefill of `layout`."""

    def __init__(self, layout: Layout, fresh: list[int], num_layers: int, question: list[int]):
        self.lay, self.fresh, self.L = layout, fresh, num_layers
        fresh_rows = [r for s in fresh for r in range(layout.edges[s], layout.edges[s + 1])]
        need = sorted(set(fresh_rows) | set(question))
        self.rows = torch.tensor(fresh_rows, dtype=torch.long)  # sorted: fresh chunks in prompt order
        self.with_question = torch.tensor(need, dtype=torch.long)  # rows whose mass the question adds
        where = {r: i for i, r in enumerate(need)}
        self._fresh_in = torch.tensor([where[r] for r in fresh_rows], dtype=torch.long)
        self._question_in = torch.tensor([where[r] for r in question], dtype=torch.long)
        self.span: dict[int, tuple[int, int]] = {}  # s -> its rows among the fresh rows
        at = 0
        for s in fresh:
            t = len(layout.segments[s].tokens)
            self.span[s] = (at, at + t)
            at += t
        self.kv: list[tuple[Tensor, Tensor]] = []  # per layer, k and v of every fresh row
        self._mass: list[Tensor | Later] = []  # per layer, the fresh rows' mass [fresh rows, S], or its inputs
        self._done: dict[int, VariantStats] | None = None  # per fresh chunk, once computed
        self._lock = threading.Lock()

    def mass_rows(self, question: bool) -> Tensor:
        """The prompt rows whose mass a layer should return (sorted): the fresh chunks', and
        the question's where it is asked for too."""
        return self.with_question if question else self.rows

    def record(self, rows_in: Tensor, k: Tensor, v: Tensor, mass: Tensor | Later, question: bool) -> Tensor | None:
        """One layer: k, v [Hkv, R, D] of the rows `rows_in` whose K/V it wrote, and the mass
        [M, S] of `mass_rows(question)` (or, for the fresh rows alone, what it is computed from
        later). Returns the question rows' mass where it was asked for."""
        if self.fresh:
            at = torch.searchsorted(rows_in, self.rows)
            self.kv.append((k.index_select(1, at), v.index_select(1, at)))
            self._mass.append(mass.index_select(0, self._fresh_in) if question else mass)  # [fresh rows, S]
        return mass.index_select(0, self._question_in) if question else None

    def later(self, q: Tensor, rows: Any, K: Tensor, k_pos: Tensor, scale: float) -> Later:
        """A layer's mass of the fresh rows, computed after the pass: q [Hq, R, D] of the
        layer's `rows` (`step.Rows`, the fresh rows among them), over its cache K at k_pos."""
        if self.rows.shape[0] == rows.count:  # every row is fresh (a full prefill): no copy
            return Later(q, rows.pos, K, k_pos, scale)
        at = rows.index_of(self.rows)
        return Later(q.index_select(1, at), rows.pos.index_select(0, at), K, k_pos, scale)

    def now(self) -> None:
        """Compute the mass put off so far, before a catch-up writes rows into those layers'
        caches (a fallback): what the layers held when they ran."""
        self._mass = [self._computed(m) for m in self._mass]

    def _computed(self, m: Tensor | Later) -> Tensor:
        if not isinstance(m, Later):
            return m
        return attention_mass(m.q, m.q_pos, m.K, m.k_pos, self.lay.bounds, scale=m.scale)

    def chunks(self) -> dict[int, FreshChunk]:
        """The fresh chunks: their KV now, their statistics when first read."""
        return {s: FreshChunk(prefix=self.lay.keys[:s],
                              kv=[(k[:, a:b].contiguous(), v[:, a:b].contiguous()) for k, v in self.kv],
                              later=lambda s=s: self._stats()[s])
                for s, (a, b) in self.span.items()}

    def _stats(self) -> dict[int, VariantStats]:
        with self._lock:
            if self._done is None:
                self._done = self._compute()
                self._mass = []  # the queries and caches held for it go
            return self._done

    def _compute(self) -> dict[int, VariantStats]:
        inter: Tensor | None = None  # [fresh rows, S] sum over layers of their mass per segment
        intra: dict[int, list[Tensor]] = {s: [] for s in self.fresh}  # per layer, mass to own chunk (0-d)
        for m in map(self._computed, self._mass):
            inter = m if inter is None else inter + m  # eq. 3 per token and segment
            for s, (a, b) in self.span.items():
                intra[s].append(m[a:b, s].sum())  # eq. 4
        # eq. 4's sums, one read for every layer and chunk, added up in that order as floats
        flat = torch.stack([x for s in self.fresh for x in intra[s]]).tolist() if self.fresh else []
        out, at = {}, 0
        for s in self.fresh:
            mine, at = flat[at:at + len(intra[s])], at + len(intra[s])
            t = len(self.lay.segments[s].tokens)
            a, b = self.span[s]
            per_token = inter[a:b, :s].contiguous()  # [t, s]
            per_chunk = per_token.sum(0) / (self.L * t)  # eq. 9-10, one per prefix chunk
            b_sum = 0.0
            for x in mine:
                b_sum += x
            out[s] = VariantStats(
                a=float(per_chunk.sum()),
                b=b_sum / (self.L * t),
                prefix_attention=tuple(per_chunk.tolist()),
                token_inter_attention=tuple(per_token.sum(1).tolist()),  # eq. 14 input; one read, not one a token
            )
        return out


__all__ = ["FreshStats"]
