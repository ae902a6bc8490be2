"""What one pass knows of its prompt and the stored KV, beside the loop (`loop.py`): which chunks
are still served from stored KV, each layer's merged cache, and the rows as they change.

A layer's cache (`cache`): the stored RoPE-free K/V of the live chunks and zeros between them,
in prompt order, in one concatenation each (`pieces`: views made once, not per layer), rows an
earlier pass carried through layer 0 written in; the step rotates K to the prompt's positions
and writes its rows over it. Where an earlier pass merged the same layer (`Pass.caches`), the
step writes its rows over that cache instead.

A reused chunk whose layer l is absent (late past `patience`, missing, corrupt) is computed from then on
(`fall_back`). Its rows need hidden states at layer l, which were never computed, so they are
caught up: run through layers 0..l-1 over the merged caches (their K/V written there), then
they join the computed rows at layer l. Correct first; it costs l layers of that chunk,
logged once per event.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from engine_adapter.llama import rope_for_spec
from engine_adapter.prompt import Layout
from engine_adapter.result import BlendResult
from engine_adapter.rowset import RowSet, RowSets
from engine_adapter.selection import Carry, Pass
from engine_adapter.source import LayerKV, LayerSource
from engine_adapter.step import LayerCache, Rotation
from kvkernels import rope_tables

log = logging.getLogger(__name__)


class Merge:
    def __init__(self, model: Any, lay: Layout, spec: Pass, source: LayerSource, layer_budget_s: float) -> None:
        c = model.cfg
        self.m, self.lay, self.spec, self.source, self.budget_s = model, lay, spec, source, layer_budget_s
        self.n, self.hkv, self.hd, self.layers = lay.n, c.num_kv_heads, c.head_dim, c.num_layers
        stored = model.model_spec()
        # stored KV holds every KV head; one rank of a tensor-parallel engine reads its own
        self.stored_hkv = stored.num_kv_heads
        self.heads = None if model.ranks is None else slice(*model.ranks.kv_heads(self.stored_hkv))
        self.live = list(spec.reused)  # reused chunks still served from stored KV
        self.reused_host = [False] * self.n  # rows of reused chunks
        for s in spec.reused:
            self.reused_host[lay.span(s)] = [True] * len(lay.segments[s].tokens)
        self.reused_tokens = sum(self.reused_host)
        self.live_host = list(self.reused_host)  # rows still served from stored KV
        self.live_host[-1] = False  # the last row is always computed
        self.question = list(lay.question_rows())
        hidden = torch.zeros(self.n, dtype=torch.bool)
        if spec.hidden:
            hidden.index_fill_(0, torch.tensor(list(spec.hidden), dtype=torch.long), True)
        self.pos = torch.where(hidden, self.n, torch.arange(self.n))  # [N] where the attention sees each key
        self.rot = Rotation(*rope_tables(rope_for_spec(stored), torch.arange(self.n)), model.triton)
        self.rowsets = RowSets(self.n, self.pos, self.rot, self.live_host, self.reused_host, triton=model.triton,
                               heads=c.num_heads, kv_heads=self.hkv, head_dim=self.hd, dtype=model.dtype,
                               causal=not spec.hidden, runs=not spec.whole, grouped=spec.whole,
                               engine=model.attention)
        self._zeros = torch.zeros(self.hkv, self.n, self.hd, dtype=model.dtype)  # rows neither stored nor computed
        self._raw = torch.empty(self.hkv, self.n, self.hd, dtype=model.dtype)  # a layer's K before its rotation
        self.res = BlendResult(logits=torch.empty(0), kv=[], reuse=bool(spec.reused),
                               reused_tokens=self.reused_tokens, prompt_tokens=self.n)
        self.merge_s = 0.0  # the last layer's merge of the stored K/V
        self._pieces()

    def _pieces(self) -> None:
        """`pieces`: the prompt in order as a layer's merge concatenates it, a live chunk's index
        (its stored K/V) or zeros for a run of rows not stored."""
        self.pieces: list[int | Tensor] = []
        live, zeros = set(self.live), 0
        for s in range(len(self.lay.segments) + 1):
            if s < len(self.lay.segments) and s not in live:
                zeros += len(self.lay.segments[s].tokens)
                continue
            if zeros:
                self.pieces.append(self._zeros[:, :zeros])
                zeros = 0
            if s < len(self.lay.segments):
                self.pieces.append(s)

    def stored_pieces(self, got: LayerKV) -> tuple[list[Tensor], list[Tensor]]:
        """A layer's K and V in prompt order: the live chunks' stored K/V that arrived (`got`)
        and zeros between them."""
        return ([got[x][0] if isinstance(x, int) else x for x in self.pieces],
                [got[x][1] if isinstance(x, int) else x for x in self.pieces])

    # ---- rows ----------------------------------------------------------------------------

    def first_rows(self) -> tuple[RowSet, Tensor]:
        """The rows that run layer 0 (less those carried through it) and their embeddings."""
        want = set(self.spec.first) | {self.n - 1}
        if self.spec.carry is not None:
            want -= set(self.spec.carry.rows.tolist())
        p = self.rowsets.of(sorted(want))
        return p, self.m.embed(self.lay.tokens.index_select(0, p.rows))

    def question_among(self, p: RowSet, after_choice: bool = False) -> Tensor | None:
        """[R] 1 at the question's rows among p's (`after_choice`: among those a choice that
        keeps no candidate leaves), 0 at the others; None where they are all the question's.
        Once per set of rows."""
        key = ("question", after_choice)
        if key not in p.memo:
            host = p.on_host()
            if after_choice:
                host = tuple(r for r in host if not self.live_host[r])
            asks = set(self.question)
            at = [float(r in asks) for r in host]
            p.memo[key] = None if all(at) else torch.tensor(at)
        return p.memo[key]

    def kept(self, p: RowSet, h: Tensor | None, keep: list[int]) -> tuple[RowSet, Tensor | None]:
        """Rows `keep` (indices into p's rows) alone, with their hidden states (h None: none)."""
        if len(keep) == p.rows.shape[0]:
            return p, h
        host = p.on_host()
        return (self.rowsets.of([host[i] for i in keep]),
                None if h is None else h.index_select(0, torch.tensor(keep, dtype=torch.long)))

    def dropped(self, p: RowSet, h: Tensor | None, drop: Sequence[int]) -> tuple[RowSet, Tensor | None]:
        """Rows p less the prompt rows `drop` (a selection's)."""
        if not drop:
            return p, h
        gone = set(drop)
        return self.kept(p, h, [i for i, r in enumerate(p.on_host()) if r not in gone])

    def joined(self, p: RowSet, h: Tensor, carry: Carry) -> tuple[RowSet, Tensor]:
        """Rows p and the carried rows, which join after layer 0 with their hidden states."""
        return self._union(p.on_host(), h, tuple(carry.rows.tolist()), carry.h)

    def _union(self, host: tuple[int, ...], h: Tensor, more: tuple[int, ...], h_more: Tensor) -> tuple[RowSet, Tensor]:
        """Rows `host` (hidden states h) and rows `more` (h_more), in prompt order."""
        both = host + more
        rows = sorted(both)
        at = {r: i for i, r in enumerate(both)}
        order = torch.tensor([at[r] for r in rows], dtype=torch.long)
        return self.rowsets.of(rows), torch.cat([h, h_more]).index_select(0, order)

    # ---- stored KV -----------------------------------------------------------------------

    def wait(self, layer: int) -> LayerKV:
        """The live chunks' stored K/V of `layer` that arrived intact by the layer's deadline
        (`patience`; this rank's heads of it; on a tensor-parallel engine, those that reached
        every rank)."""
        if not self.live:
            return {}
        got = self.source.wait_layer(layer, time.monotonic() + self.patience())
        want = {s: len(self.lay.segments[s].tokens) for s in self.live}
        got = {s: self._own(kv) for s, kv in got.items() if s in want and self._valid(kv, want[s])}
        if self.m.ranks is not None:
            have = self.m.ranks.all_have([s in got for s in self.live])
            got = {s: got[s] for s, ok in zip(self.live, have) if ok}
        return got

    def patience(self) -> float:
        """How long the next layer of the live chunks is waited for: up to what falling back
        would cost, the live chunks' rows through every layer (caught up through the layers
        before, computed in the rest) at the pass's rate so far (at layer 0, the model's last
        pass's), and at least `layer_budget_s` (alone before any pass has a rate). Waiting up to
        the price of the alternative and then paying it never costs more than twice the better
        of the two choices made knowing when the layer arrives (rent or buy: Karlin, Manasse,
        Rudolph & Sleator, "Competitive snoopy caching", 1988). A layer a slow tier streams
        behind the compute (a disk read) is waited for where the catch-up would cost more; a
        stream that ended answers at once either way."""
        rate = self.pass_rate()
        rate = self.m.row_layer_s if rate is None else rate
        if rate is None:
            return self.budget_s
        live = sum(len(self.lay.segments[s].tokens) for s in self.live)
        return max(self.budget_s, rate * live * self.layers)

    def pass_rate(self) -> float | None:
        """Seconds per row-layer this pass has computed so far; None before its first layer."""
        rows = sum(self.res.computed_rows)
        return sum(t.compute_s for t in self.res.timings) / rows if self.res.timings and rows else None

    def priced(self) -> None:
        """After the pass: its rate is the model's price of falling back at the next pass's
        layer 0 (`LayerModel.row_layer_s`)."""
        rate = self.pass_rate()
        if rate is not None:
            self.m.row_layer_s = rate

    def _valid(self, kv: tuple[Tensor, Tensor], t: int) -> bool:
        return len(kv) == 2 and all(x.shape == (self.stored_hkv, t, self.hd) and x.dtype == self.m.dtype for x in kv)

    def _own(self, kv: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """This rank's heads of a chunk's stored K/V (views)."""
        return kv if self.heads is None else (kv[0][self.heads], kv[1][self.heads])

    def cache(self, layer: int, got: LayerKV, p: RowSet, chooses: bool) -> LayerCache:
        """The layer's cache for the eager step: the rows' own K/V where they are every row in
        order (nothing stored is read: full prefill's cache); an earlier pass's to write over
        where there is one (and neither carried rows nor a choice, which compares with the
        stored K/V, need a merge); else the stored K/V merged (`pieces`)."""
        t0, self.merge_s = time.perf_counter(), 0.0
        earlier = self.spec.caches.get(layer)
        carry = self.spec.carry if layer == 0 else None
        if p.host is not None and len(p.host) == self.n and not (carry or chooses or self.spec.hidden):
            return LayerCache(None, None, None)
        if earlier is not None and carry is None and not chooses:
            return LayerCache(*earlier, self.pos)
        k, v = self.stored_pieces(got)
        torch.cat(k, 1, out=self._raw)
        V = torch.cat(v, 1)
        if carry is not None:  # RoPE-free K: the step rotates it with the stored K
            self._raw.index_copy_(1, carry.rows, carry.k)
            V.index_copy_(1, carry.rows, carry.v)
        self.merge_s = time.perf_counter() - t0
        return LayerCache(None, V, self.pos, self._raw, self.rot)

    def written(self, layer: int) -> LayerCache:
        """The layer's merged cache as it is, for rows to be written over (a catch-up)."""
        return LayerCache(*self.res.kv[layer], self.pos)

    def fall_back(self, layer: int, got: LayerKV, p: RowSet, h: Tensor,
                  catch_up: Callable[[int, RowSet, Tensor], Tensor]) -> tuple[RowSet, Tensor]:
        """Chunks absent at `layer` are computed from now on; their rows caught up through
        0..layer-1 (`catch_up`)."""
        absent = [s for s in self.live if s not in got]
        if not absent:
            return p, h
        self.live = [s for s in self.live if s in got]
        self.res.fallbacks += [(s, layer) for s in absent]
        fallen = [r for s in absent for r in range(self.lay.edges[s], self.lay.edges[s + 1])]
        for r in fallen:
            self.live_host[r] = False
        self._pieces()
        host = p.on_host()
        have = set(host)
        new = [r for r in fallen if r not in have]  # rows already computed have their hidden states
        log.warning("blend: layer %d of chunk(s) %s absent (late/missing/corrupt); computing them "
                    "from here on%s", layer, absent,
                    f", catching up {len(new)} rows through layers 0..{layer - 1}" if layer and new else "")
        if not new:
            return self.rowsets.of(host), h
        pn = self.rowsets.of(new)
        hn = catch_up(layer, pn, self.m.embed(self.lay.tokens.index_select(0, pn.rows)))
        return self._union(host, h, tuple(new), hn)


__all__ = ["Merge"]
