"""The per-layer loop of one pass of a blended prefill (docs/adapter.md, "One layer step").

Before the first layer: the rows the pass computes (`Pass.first`) and what derives from them
(`rowset`). Then per layer (Cache-Craft §3.4.3; CacheBlend §4), whatever the policy:
  1. wait for layer l of the reused chunks, until a deadline (`layer_budget_s`); a chunk
     absent (late, missing, corrupt; at tensor parallel > 1, on any rank) is computed from
     then on (`merge.Merge.fall_back`); the ranks check they hold the same rows (`ranks`);
  2. the layer's cache: the stored RoPE-free K/V of the live chunks in prompt order, zeros
     between them, or an earlier pass's cache to write over (`merge.Merge.cache`);
  3. one layer step (`step.layer_step`, or its capture, `graphs`): Q/K/V of the rows, the
     stored K rotated, the rows' K/V written, the selection's choice of rows (`Selection.choice`),
     attention by position (with what the selection and the statistics ask back), o-proj, MLP;
  4. the selection sees what it asked for and drops rows (`Selection.drop`); the fresh
     chunks' statistics are recorded (`stats`).
Within a layer nothing reads a device value on the host, and the operations dispatched per
layer do not depend on the number of chunks or rows (tests/engine_adapter/test_op_count.py);
what changes the rows (a choice, a drop, a fallback) derives what depends on them once.
At the last layer every row's K/V is written and the rest of the layer runs for the last row
alone, unless what the pass returns or reads needs more (`run`). After the last layer: the
logits of the last prompt row (all rows on request).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from torch import Tensor

from engine_adapter.dispatch import StaticRunner
from engine_adapter.merge import Merge
from engine_adapter.model import own
from engine_adapter.prompt import Layout
from engine_adapter.result import BlendResult, LayerTiming
from engine_adapter.rowset import RowSet
from engine_adapter.selection import LayerView, Pass, Seen
from engine_adapter.source import LayerSource
from engine_adapter.stats import FreshStats
from engine_adapter.step import Choice, Rows, Stepped, layer_step
from kvkernels import KeyReads


@torch.no_grad()
def run_pass(model: Any, lay: Layout, spec: Pass, source: LayerSource, layer_budget_s: float, *,
             steps: Any = None, all_logits: bool = False) -> BlendResult:
    """One pass (`Pass`) over the layers. `steps`: the model's static steps (`graphs.StepGraphs`),
    used where this prefill gets them (another prefill may hold them: then eagerly)."""
    if steps is None or spec.rescale is not None:
        return _Loop(model, lay, spec, source, layer_budget_s, None).run(all_logits)
    with steps.lease() as leased:
        return _Loop(model, lay, spec, source, layer_budget_s, steps if leased else None).run(all_logits)


class _Loop:
    def __init__(self, model: Any, lay: Layout, spec: Pass, source: LayerSource, layer_budget_s: float,
                 steps: Any) -> None:
        self.m, self.lay, self.spec, self.sel = model, lay, spec, spec.selection
        self.L = model.cfg.num_layers
        self.merge = Merge(model, lay, spec, source, layer_budget_s)
        self.res = self.merge.res
        fresh = [s for s, seg in enumerate(lay.segments) if spec.stats and not seg.question and s not in spec.reused]
        self.stats = FreshStats(lay, fresh, self.L, self.merge.question)
        self.static = None if steps is None else StaticRunner(steps, self.merge)
        self.reads: KeyReads | None = None  # made at the first layer whose selection asks for reads
        self.last_only = False  # the last layer may run the rest of it for the last row alone (`run`)
        self.ran_alone: Rows | None = None  # the rows the last layer step ran its rest for, where it was some

    def static_ran(self, layer: int) -> bool:
        return self.static is not None and self.static.ran(layer)

    def view(self, layer: int, p: RowSet) -> LayerView:
        return LayerView(self.lay, layer, self.L, p.on_host, p.n_cand, self.merge.reused_tokens, self.merge.live,
                         self.merge.question)

    def run(self, all_logits: bool) -> BlendResult:
        depth = self.L if self.spec.depth is None else self.spec.depth
        # After the last layer only the last row's hidden state is read (the next token's logits):
        # every row's K/V is written there, and the attention and o-proj and MLP run for the last
        # row alone, unless the pass returns every row's logits or a selection or the statistics
        # read the layer's attention (`layer`).
        self.last_only = depth == self.L and not all_logits
        p, h = self.merge.first_rows()
        for layer in range(depth):
            t0 = time.perf_counter()
            got = self.merge.wait(layer)
            t1 = time.perf_counter()
            p, h = self.merge.fall_back(layer, got, p, h, self.catch_up)
            if self.m.ranks is not None:  # a tensor-parallel engine's ranks compute one set of rows
                self.m.ranks.same_rows(f"the rows of layer {layer}", p.rows)
            view = self.view(layer, p)
            wants = self.sel.wants(view)
            cand = p.cand  # the candidates the layer's choice, if any, chose among
            out, p = self.layer(layer, view, p, h, got, wants.reads, wants.mass)
            h = out.h
            self.sel.seen(view, self.seen(out, p, cand, wants.mass))
            self.res.computed_rows.append(p.rows.shape[0])
            self.res.recomputed_rows.append(p.recomputed)
            drop = self.sel.drop(self.view(layer, p))
            if self.ran_alone is None:
                p, h = self.merge.dropped(p, h, drop)
            else:  # (the last layer's rest ran for the last row alone: h is its hidden state)
                p = self.merge.dropped(p, None, drop)[0]
            if layer == 0 and self.spec.carry is not None:
                p, h = self.merge.joined(p, h, self.spec.carry)
            self.res.timings.append(LayerTiming(wait_s=t1 - t0, compute_s=time.perf_counter() - t1,
                                                rotate_s=self.merge.merge_s + out.rotate_s, attend_s=out.attend_s,
                                                static=self.static_ran(layer)))
        self.merge.priced()
        if self.static is not None:
            self.static.own(self.res.kv)
        reads = None if self.reads is None else self.reads.total()[:self.lay.n]
        if reads is not None and self.m.ranks is not None:
            reads = self.m.ranks.sum(reads)  # every rank's query heads
        self.sel.finish(self.view(depth, p), reads)
        self.res.reused_segments = list(self.merge.live)
        if depth < self.L:
            return self.res
        t = time.perf_counter()
        logits = self.m.logits(h if all_logits else h[-1:])  # the rows are sorted: the last is the last prompt row
        self.res.logits, self.res.logits_s = logits[-1], time.perf_counter() - t
        self.res.last_hidden = h[-1].clone()
        if all_logits:
            self.res.rows, self.res.row_logits = p.rows, logits
        self.res.fresh = self.stats.chunks()
        return self.res

    def layer(self, layer: int, view: LayerView, p: RowSet, h: Tensor, got: dict, reads: bool,
              question_mass: bool) -> tuple[Stepped, RowSet]:
        """Layer `layer` of rows p: as a static step where one runs it, else the eager step."""
        keep = self.sel.choice(view) if p.n_cand else None
        keep = None if keep is None or keep >= p.n_cand else keep
        mass_of = self.stats.mass_rows(question_mass) if (self.stats.fresh or question_mass) else None
        # the statistics' alone, on the CPU: computed after the pass (`stats.py`)
        later = mass_of is not None and not question_mass and not self.m.triton and self.static is None
        mass_of = None if later else mass_of
        key_reads = self.key_reads() if reads else None
        rest = self.ran_alone = None
        if (self.last_only and layer == self.L - 1 and self.static is None and mass_of is None and not later
                and key_reads is None and self.spec.rescale is None):
            rest = self.ran_alone = self.merge.rowsets.of([self.lay.n - 1]).step
        if self.static is not None:
            done = self.static.layer(layer, p, h, got, self.spec.carry if layer == 0 else None, keep, key_reads,
                                     self.merge.question_among, mass_of)
            if done is not None:
                self.res.kv.append((done[0].K, done[0].V))
                return done
        chosen: list[RowSet] = []
        choice = None
        if keep is not None:
            choice = Choice(p.cand, p.n_cand, keep, p.rows.shape[0] - p.n_cand + keep,
                            lambda kept, real, cand: self.chosen(p, kept, cand, keep, chosen))
        cache = self.merge.cache(layer, got, p, keep is not None)
        reads_rows = None
        if key_reads is not None:
            assert not keep, "a choice that keeps candidates with the question's reads"
            reads_rows = self.merge.question_among(p, after_choice=keep is not None)
        out = layer_step(self.m, layer, h, p.step, cache, choice=choice, mass_of=mass_of, reads=key_reads,
                         reads_rows=reads_rows, segments=self.lay.bounds if mass_of is not None else None,
                         rescale=self.spec.rescale, rest=rest)
        if later:
            out.mass = self.stats.later(out.q, out.rows, out.K, out.rows.rows if cache.pos is None else cache.pos,
                                        self.m.scale)
        self.res.kv.append((own(out.K), own(out.V)))  # a full prefill's are views of larger tensors
        return out, (chosen[0] if chosen else p)

    def chosen(self, p: RowSet, kept: Tensor, cand: Tensor, keep: int, into: list[RowSet]) -> Rows:
        into.append(self.merge.rowsets.chosen(p, p.rows.index_select(0, kept), cand, keep))
        return into[0].step

    def key_reads(self) -> KeyReads:
        """Where the attention adds up what the question reads of each key: the static steps'
        bucket's (over its tokens: the first n are the prompt's), else one over the prompt's."""
        if self.reads is None:
            bucket = self.static.reads() if self.static is not None else None
            self.reads = bucket if bucket is not None else KeyReads(self.lay.n, self.m.device)
        return self.reads

    def seen(self, out: Stepped, p: RowSet, cand: Tensor | None, question_mass: bool) -> Seen:
        ran = p.rows if self.ran_alone is None else self.ran_alone.rows  # the rows of out.h
        seen = Seen(ran, out.h, out.qkv, out.rows_in, self.m.cfg.num_kv_heads, out.deviation, cand)
        if out.mass is None:
            return seen
        mass = self.stats.record(out.rows_in, seen.k, seen.v, out.mass, question_mass)
        if mass is not None and self.m.ranks is not None:
            mass = self.m.ranks.mean(mass)  # a mean over every rank's heads
        return dataclasses.replace(seen, mass=mass)

    def catch_up(self, layer: int, p: RowSet, h: Tensor) -> Tensor:
        """Rows p through layers 0..layer-1 over the merged caches (their K/V written there)."""
        self.stats.now()  # the statistics' mass over those caches as they were
        for before in range(layer):
            h = layer_step(self.m, before, h, p.step, self.merge.written(before), rescale=self.spec.rescale).h
        return h
