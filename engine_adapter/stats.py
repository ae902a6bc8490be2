"""The statistics of the chunks a prefill computes fresh (Cache-Craft §3.1,
`kvcraft.records.VariantStats`), observed from the layer steps: each fresh chunk's K/V per
layer (RoPE-free: the variant to store) and the attention mass its rows put on each segment.

Every row of a fresh chunk is computed at every layer, so the mass of those rows, which the
attention returns per segment where asked (`attention.attend`'s `mass_rows`), gives per token
and segment eq. 3's inter-attention (summed over layers) and per chunk eq. 4's intra-attention;
eq. 9-10 average them into a and b, eq. 14's per-token totals rank a later reuse's recompute
list."""

from __future__ import annotations

import torch
from torch import Tensor

from engine_adapter.prompt import Layout
from engine_adapter.result import FreshChunk
from kvcraft.records import VariantStats


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
        self._inter: Tensor | None = None  # [fresh rows, S] sum over layers of their mass per segment
        self._intra: dict[int, list[Tensor]] = {s: [] for s in fresh}  # per layer, mass to own chunk (0-d)

    def mass_rows(self, question: bool) -> Tensor:
        """The prompt rows whose mass a layer should return (sorted): the fresh chunks', and
        the question's where it is asked for too."""
        return self.with_question if question else self.rows

    def record(self, rows_in: Tensor, k: Tensor, v: Tensor, mass: Tensor, question: bool) -> Tensor | None:
        """One layer: k, v [Hkv, R, D] of the rows `rows_in` whose K/V it wrote, and the mass
        [M, S] of `mass_rows(question)`. Returns the question rows' mass where it was asked for."""
        if self.fresh:
            at = torch.searchsorted(rows_in, self.rows)
            self.kv.append((k.index_select(1, at), v.index_select(1, at)))
            m = mass.index_select(0, self._fresh_in) if question else mass  # [fresh rows, S]
            self._inter = m if self._inter is None else self._inter + m  # eq. 3 per token and segment
            for s, (a, b) in self.span.items():
                self._intra[s].append(m[a:b, s].sum())  # eq. 4
        return mass.index_select(0, self._question_in) if question else None

    def chunks(self) -> dict[int, FreshChunk]:
        out = {}
        # eq. 4's sums, one read for every layer and chunk, added up in that order as floats
        flat = torch.stack([x for s in self.fresh for x in self._intra[s]]).tolist() if self.fresh else []
        intra, at = {}, 0
        for s in self.fresh:
            intra[s], at = flat[at:at + len(self._intra[s])], at + len(self._intra[s])
        for s in self.fresh:
            t = len(self.lay.segments[s].tokens)
            a, b = self.span[s]
            inter = self._inter[a:b, :s].contiguous()  # [t, s]
            per_chunk = inter.sum(0) / (self.L * t)  # eq. 9-10, one per prefix chunk
            b_sum = 0.0
            for x in intra[s]:
                b_sum += x
            out[s] = FreshChunk(
                prefix=self.lay.keys[:s],
                kv=[(k[:, a:b].contiguous(), v[:, a:b].contiguous()) for k, v in self.kv],
                stats=VariantStats(
                    a=float(per_chunk.sum()),
                    b=b_sum / (self.L * t),
                    prefix_attention=tuple(per_chunk.tolist()),
                    token_inter_attention=tuple(inter.sum(1).tolist()),  # eq. 14 input; one read, not one a token
                ),
            )
        return out


__all__ = ["FreshStats"]
