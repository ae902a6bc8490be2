"""Which layer of a prefill runs as a static step, and how (vLLM's CudagraphDispatcher in
kvcraft's terms): one place that maps a layer to a key of `graphs.StepGraphs` (a bucket of
tokens and rows, with or without a choice of rows, reads and mass or not) or to the eager step.

A layer runs static where the prefill leased the static steps and the device had memory for
the bucket; its selection's choice, if any, is one the step makes on the device
(`step.Choice`). Reads, where asked for, the attention adds up inside the step where every
row that attends is the question's; else (a chunk caught up after a fallback runs the layer
too) they are the question's rows' probabilities again, beside the step. Carried rows
(`selection.Carry`) have their K/V written into the bucket's buffers before the step, where
the eager merge writes them. An earlier pass's caches are not
written over here: the stored K/V are merged afresh into the bucket (the same cache, bit for
bit, in two copies and the step's own launch). Otherwise (a catch-up after a fallback, a
failed capture) the eager step runs the layer.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import Tensor

from engine_adapter.attention import add_reads
from engine_adapter.graphs import StaticStep, StepFailed, StepGraphs
from engine_adapter.merge import Merge
from engine_adapter.rowset import RowSet
from engine_adapter.selection import Carry
from engine_adapter.source import LayerKV
from engine_adapter.step import Stepped
from kvkernels import KeyReads


class StaticRunner:
    """One prefill's use of an engine's static steps (leased for it)."""

    def __init__(self, steps: StepGraphs, merge: Merge) -> None:
        self.steps, self.merge = steps, merge
        self.n = merge.n
        self.on = True  # False once a bucket found no memory or a step failed: eager from there
        self.loaded: tuple[StaticStep, RowSet, Tensor] | None = None  # the rows a step has loaded
        self.cc = None  # the bucket of tokens this prefill's static steps wrote
        self.layers: list[int] = []  # the layers that ran static
        self.placed = False  # the bucket's key positions are this prefill's
        self.segments = 0  # S' of the bucket's segments (`graphs.Caches.segments_of`), 0: none yet

    def _bucket(self, make: Callable):  # noqa: ANN202 - make() or None
        """`make()`, a bucket of the static steps, or None where the device has no memory for
        its buffers (`StepGraphs.out_of_memory`): this prefill runs eagerly from here."""
        try:
            return make()
        except torch.OutOfMemoryError as e:
            self.steps.out_of_memory(self.n, e)
            self.on = False
            return None

    def reads(self) -> KeyReads | None:
        """The bucket's reads, cleared (its first n keys are the prompt's), or None (eager)."""
        cc = self._bucket(lambda: self.steps.caches(self.n)) if self.on else None
        if cc is not None:
            cc.reads.clear()
            return cc.reads
        return None

    def layer(self, layer: int, p: RowSet, h: Tensor, got: LayerKV, carry: Carry | None, keep: int | None,
              reads: KeyReads | None, question_among: Callable, mass_of: Tensor | None
              ) -> tuple[Stepped, RowSet] | None:
        """Layer `layer` of rows p as a static step (the module docstring), or None: eagerly."""
        if not self.on:
            return None
        weights = None if reads is None else question_among(p, after_choice=keep is not None)
        R = p.rows.shape[0]
        R_out = R - p.n_cand + keep if keep is not None else R
        static = self._bucket(lambda: self.steps.step(self.n, R, R_out if keep is not None else None))
        if static is None or (reads is not None and reads is not static.caches.reads):
            return None
        inside = reads is not None and weights is None
        m, cc = self.merge, static.caches
        self.cc = cc
        t0, m.merge_s = time.perf_counter(), 0.0
        if not self.placed:
            cc.keys_at(m.pos)
            self.placed = True
        if mass_of is not None and not self.segments:
            self.segments = cc.segments_of(m.lay.bounds, self.n)
        cc.merge(layer, *m.stored_pieces(got), self.n)
        if carry is not None:  # RoPE-free K: the step rotates it with the stored K
            cc.raw.index_copy_(1, carry.rows, carry.k)
            cc.V[layer].index_copy_(1, carry.rows, carry.v)
        loaded = self.loaded
        if keep is not None or loaded is None or not (loaded[0] is static and loaded[1] is p and loaded[2] is h):
            static.load(p.rows, h)
        if keep is not None:
            static.choose(p.cand, keep)
        m.merge_s = time.perf_counter() - t0
        try:
            out = static.run(layer, inside, self.segments if mass_of is not None else 0)
        except StepFailed as e:  # its inputs as they were: the eager step runs the layer, and the rest
            self.steps.fail(e)
            self.on = False
            return None
        if keep is not None:
            q = m.rowsets.chosen(p, static.out_rows.rows[:R_out].clone(), static.cand_out[:keep].clone(), keep)
            h = static.h_out[:R_out]
        else:
            q, h = p, static.h[:R]
        mass = None
        if mass_of is not None:
            mass = out.mass[:R_out, :len(m.lay.segments)].index_select(0, torch.searchsorted(q.rows, mass_of))
        self.loaded = (static, q, h)
        self.layers.append(layer)
        K, V = cc.K[layer][:, :self.n], cc.V[layer][:, :self.n]
        if reads is not None and not inside:
            add_reads(reads, out.q[:, :R_out], q.rows, K, m.pos, m.m.scale, weights)
        dev = None if keep is None else out.deviation[:p.n_cand]
        return Stepped(q.step, p.rows, h, out.q, out.qkv[:, :R], K, V, deviation=dev, mass=mass), q

    def ran(self, layer: int) -> bool:
        return self.layers[-1:] == [layer]

    def own(self, kv: list[tuple[Tensor, Tensor]]) -> None:
        """The static steps' caches are the bucket's, written again by the next prefill: the
        result's layers become copies, one per K and V for each run of consecutive layers that
        ran static (one in all where every layer did)."""
        if not self.layers:
            return
        runs: list[list[int]] = []
        for layer in self.layers:
            if runs and runs[-1][-1] == layer - 1:
                runs[-1].append(layer)
            else:
                runs.append([layer])
        for run in runs:
            K, V = (x[run[0]:run[-1] + 1, :, :self.n].clone() for x in (self.cc.K, self.cc.V))
            kv[run[0]:run[-1] + 1] = list(zip(K.unbind(0), V.unbind(0)))
