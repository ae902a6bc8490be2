"""Blended prefill: reuse stored chunk KV, recompute only the rows that need it, layer by layer.

Per layer l (design card, "Adapter"; Cache-Craft §3.4.3; CacheBlend §4):
  1. wait for layer l of the reused chunks, until a deadline (`Policy.layer_budget_s`);
  2. rotate their RoPE-free K to the chunks' new positions;
  3. Q/K/V for the computed rows only (fresh chunks, the question, the recompute set);
  4. scatter the computed K/V into the merged cache, selective attention of the
     computed rows over it (position-causal), with attention mass per segment;
  5. o-proj + MLP for the computed rows; choose the rows of layer l+1 (focused-chunk
     early termination). The last prompt row is always computed.
  HKVD (CacheBlend) selects between 3 and 4: of the rows whose K/V were just computed,
  only the highest-deviation ones run attention + MLP on.

A reused chunk whose layer l is absent (late, missing, corrupt) is computed from then on.
Its rows need hidden states at layer l, which were never computed, so the driver
catches them up: it runs those rows through layers 0..l-1 over the merged cache
(overwriting the chunk's K/V there), then they join the computed rows at layer l.
Correct first; it costs l layers of that chunk, logged once per event.

The adapter, not the engine, applies RoPE, with the parameters of the engine's
`ModelSpec` (what stored caches are keyed by). The reuse probe (`probe.py`) checks once
per model fingerprint that this agrees with the engine's own full prefill.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch
from torch import Tensor

from engine_adapter.llama import LlamaEngine, rope_for_spec
from engine_adapter.policy import FocusTracker, Policy
from engine_adapter.prompt import Layout, Segment
from engine_adapter.source import LayerKV, LayerSource
from kvclient.types import VariantStats
from kvkernels import apply_rope, kv_deviation_topk

log = logging.getLogger(__name__)


class Gate(Protocol):
    def allows(self, engine: LlamaEngine) -> bool:
        """May this engine's model reuse stored KV? (The reuse probe's verdict.)"""
        ...


@dataclass(frozen=True)
class LayerTiming:
    wait_s: float  # blocked in LayerSource.wait_layer
    compute_s: float  # everything else of the layer, catch-up included


@dataclass(frozen=True)
class FreshChunk:
    """A chunk computed at every layer in this prompt: a new variant to store."""

    prefix: tuple[str, ...]  # keys of the chunks before it (the variant's prefix)
    kv: list[tuple[Tensor, Tensor]]  # per layer (K RoPE-free [Hkv,T,D], V [Hkv,T,D])
    stats: VariantStats


@dataclass
class BlendResult:
    logits: Tensor  # [V] at the last prompt position
    kv: list[tuple[Tensor, Tensor]]  # per layer merged (K post-RoPE [Hkv,N,D], V), ready for decode
    reuse: bool  # False: served without stored KV (policy full, no cached chunk, or probe said no)
    timings: list[LayerTiming] = field(default_factory=list)  # per layer; empty when served by engine.prefill
    computed_rows: list[int] = field(default_factory=list)  # rows computed per layer
    recomputed_rows: list[int] = field(default_factory=list)  # of those, rows of reused chunks
    reused_tokens: int = 0  # tokens of the chunks served from stored KV
    fresh: dict[int, FreshChunk] = field(default_factory=dict)  # segment index -> new variant
    fallbacks: list[tuple[int, int]] = field(default_factory=list)  # (chunk, layer) computed instead
    focused: frozenset[int] | None = None  # Alg. 1 F* (segment indices), if decided
    focus_layer: int | None = None  # Alg. 1 L* (0-based), if decided
    rows: Tensor | None = None  # rows computed at the last layer (with all_logits)
    row_logits: Tensor | None = None  # [len(rows), V] (with all_logits)

    @property
    def recompute_ratio(self) -> float:
        """Fraction of reused token-layers whose KV was recomputed."""
        if not self.reused_tokens or not self.recomputed_rows:
            return 0.0
        return sum(self.recomputed_rows) / (self.reused_tokens * len(self.recomputed_rows))


@torch.no_grad()
def blend_prefill(engine: LlamaEngine, segments: Sequence[Segment], policy: Policy,
                  source: LayerSource, *, gate: Gate | None = None,
                  all_logits: bool = False) -> BlendResult:
    """Prefill `segments` reusing stored chunk KV from `source` as `policy` says."""
    spec = engine.model_spec()
    lay = Layout.of(segments, spec.fingerprint())
    reused = policy.reused(lay)
    if reused:
        if gate is None:
            from engine_adapter.probe import DEFAULT_GATE as gate
        if not gate.allows(engine):
            return _serve_full(engine, lay)
    return _Blend(engine, lay, policy, source, reused).run(all_logits)


def _serve_full(engine: LlamaEngine, lay: Layout) -> BlendResult:
    logits, kv = engine.prefill(lay.tokens)
    return BlendResult(logits=logits[-1], kv=kv, reuse=False)


class _Blend:
    """State of one blended prefill; `run` is the per-layer loop."""

    def __init__(self, engine: LlamaEngine, lay: Layout, policy: Policy,
                 source: LayerSource, reused: list[int]):
        c = engine.cfg
        self.e, self.lay, self.policy, self.source = engine, lay, policy, source
        self.rope = rope_for_spec(engine.model_spec())
        self.L, self.n = c.num_layers, lay.n
        self.hkv, self.hd = c.num_kv_heads, c.head_dim
        self.pos = torch.arange(self.n)  # [N]
        self.live = list(reused)  # reused chunks still served from the cache
        self.reused_mask = torch.zeros(self.n, dtype=torch.bool)  # [N] rows of reused chunks
        for s in reused:
            self.reused_mask[lay.span(s)] = True
        self.reused_tokens = int(self.reused_mask.sum())
        self.fresh = [s for s, seg in enumerate(lay.segments) if not seg.question and s not in reused]
        self.asker = (lay.rows(len(lay.segments) - 1) if lay.segments[-1].question
                      else torch.tensor([self.n - 1]))  # rows whose attention defines inter(C_i, U)
        self.focus = FocusTracker(lay.chunk_indices(), policy.focus_window if policy.name == "cachecraft" else 0)
        self.kv: list[tuple[Tensor, Tensor]] = []
        self.res = BlendResult(logits=torch.empty(0), kv=self.kv, reuse=bool(reused),
                               reused_tokens=self.reused_tokens)
        self._stats_init()

    # ---- rows -------------------------------------------------------------------

    def initial_rows(self) -> Tensor:
        want = ~self.reused_mask
        want[-1] = True  # the last prompt token is always computed
        if self.policy.name == "cacheblend":
            want[:] = True  # first layer: full KV deviation over every reused token
        elif self.policy.name == "cachecraft":
            for s in self.live:
                start = int(self.lay.bounds[s])
                want[[start + i for i in self.lay.segments[s].recompute]] = True
        return want.nonzero().squeeze(1)

    # ---- the loop ---------------------------------------------------------------

    def run(self, all_logits: bool) -> BlendResult:
        e, lay = self.e, self.lay
        rows = self.initial_rows()  # [R] sorted
        h = e.embed(lay.tokens[rows])  # [R, d]
        for layer in range(self.L):
            t0 = time.perf_counter()
            got = self.wait(layer)
            t1 = time.perf_counter()
            rows, h = self.fall_back(layer, got, rows, h)
            K = torch.empty(self.hkv, self.n, self.hd, dtype=e.dtype)  # [Hkv, N, D] merged cache
            V = torch.empty_like(K)
            for s in self.live:  # RoPE the stored K to the chunk's new positions
                sp = lay.span(s)
                K[:, sp] = apply_rope(got[s][0], self.pos[sp], self.rope)
                V[:, sp] = got[s][1]
            self.kv.append((K, V))
            rows, h, k_raw, v, mass = self.layer(layer, rows, h)
            to_question = self.record_stats(rows, k_raw, v, mass)
            self.res.computed_rows.append(len(rows))
            self.res.recomputed_rows.append(int(self.reused_mask[rows].sum()))
            keep = self.focus_keep(layer, rows, to_question)
            rows, h = rows[keep], h[keep]
            self.res.timings.append(LayerTiming(wait_s=t1 - t0, compute_s=time.perf_counter() - t1))
        logits = e.logits(h)  # [R, V]; rows[-1] is the last prompt row
        self.res.logits = logits[-1]
        if all_logits:
            self.res.rows, self.res.row_logits = rows, logits
        self.res.fresh = self.fresh_chunks()
        self.res.focused, self.res.focus_layer = self.focus.focused, self.focus.layer
        return self.res

    def layer(self, layer: int, rows: Tensor, h: Tensor, select: bool = True
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """One layer: K/V of `rows` into the merged cache, then attention + MLP for those
        of them that stay (all, except where HKVD selects at this layer).

        Returns the rows that ran the layer, their hidden states, pre-RoPE k, v and mass.
        """
        e, K, V = self.e, *self.kv[layer]
        q, k, v = e.qkv(layer, h)  # [Hq,R,D], [Hkv,R,D] pre-RoPE
        k_rot = apply_rope(k, self.pos[rows], self.rope)
        keep = self.hkvd_keep(layer, rows, k_rot, v) if select else torch.ones(len(rows), dtype=torch.bool)
        # Every computed K/V goes in, selected or not: it came from right hidden states.
        K[:, rows] = k_rot
        V[:, rows] = v
        rows, h, q, k, v = rows[keep], h[keep], q[:, keep], k[:, keep], v[:, keep]
        p = self.pos[rows]
        o, mass = e.attend(apply_rope(q, p, self.rope), p, K, V, self.pos, self.lay.bounds)  # mass [R, S]
        return rows, e.mlp(layer, e.attn_out(layer, h, o)), k, v, mass

    def wait(self, layer: int) -> LayerKV:
        if not self.live:
            return {}
        got = self.source.wait_layer(layer, time.monotonic() + self.policy.layer_budget_s)
        want = {s: len(self.lay.segments[s].tokens) for s in self.live}
        return {s: kv for s, kv in got.items() if s in want and self._valid(kv, want[s])}

    def _valid(self, kv: tuple[Tensor, Tensor], t: int) -> bool:
        return len(kv) == 2 and all(x.shape == (self.hkv, t, self.hd) and x.dtype == self.e.dtype for x in kv)

    def fall_back(self, layer: int, got: LayerKV, rows: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        """Chunks absent at `layer` are computed from now on; catch their rows up through 0..layer-1."""
        absent = [s for s in self.live if s not in got]
        if not absent:
            return rows, h
        self.live = [s for s in self.live if s in got]
        self.res.fallbacks += [(s, layer) for s in absent]
        new = torch.cat([self.lay.rows(s) for s in absent])
        new = new[~torch.isin(new, rows)]  # rows already computed have their hidden states
        log.warning("blend: layer %d of chunk(s) %s absent (late/missing/corrupt); computing them "
                    "from here on%s", layer, absent,
                    f", catching up {len(new)} rows through layers 0..{layer - 1}" if layer and len(new) else "")
        if len(new) == 0:
            return rows, h
        hn = self.e.embed(self.lay.tokens[new])
        for l2 in range(layer):
            hn = self.layer(l2, new, hn, select=False)[1]
        rows, order = torch.cat([rows, new]).sort()
        return rows, torch.cat([h, hn])[order]

    def _live_rows(self, rows: Tensor) -> Tensor:
        """Indices into `rows` of reused tokens still served from the cache (never the last row)."""
        live_mask = torch.zeros(self.n, dtype=torch.bool)
        for s in self.live:
            live_mask[self.lay.span(s)] = True
        live_mask[-1] = False
        return live_mask[rows].nonzero().squeeze(1)

    def hkvd_keep(self, layer: int, rows: Tensor, k_rot: Tensor, v: Tensor) -> Tensor:
        """CacheBlend §4.3 gradual filtering: which of `rows` run this layer (bool mask).

        Among the reused rows still computed, keep the share `Policy.hkvd_ratio` of the
        reused tokens with the highest deviation between this layer's K/V from the
        current hidden states (k_rot, v) and the stored K/V (both K at the new positions).
        Called before the scatter, so the merged cache still holds the stored K/V.
        """
        keep = torch.ones(len(rows), dtype=torch.bool)
        ratio = self.policy.hkvd_ratio(layer)
        cand = self._live_rows(rows) if ratio is not None else rows[:0]
        if len(cand):
            K, V = self.kv[layer]
            want = ratio * self.reused_tokens / len(cand)
            at = rows[cand]
            _, top = kv_deviation_topk(k_rot[:, cand], v[:, cand], K[:, at], V[:, at], min(1.0, want))
            keep[cand] = False
            keep[cand[top]] = True
        return keep

    def focus_keep(self, layer: int, rows: Tensor, to_question: list[float]) -> Tensor:
        """Cache-Craft Alg. 1: which of `rows` continue to layer+1 (bool mask); to_question:
        inter(C_i, U) of this layer."""
        keep = torch.ones(len(rows), dtype=torch.bool)
        focused = self.focus.update(layer, to_question)
        if focused is not None:
            cand = torch.zeros(len(rows), dtype=torch.bool)
            cand[self._live_rows(rows)] = True
            # Stop recomputing tokens of unfocused reused chunks.
            for s in self.live:
                if s not in focused:
                    keep &= ~(torch.isin(rows, self.lay.rows(s)) & cand)
        return keep

    # ---- statistics (Cache-Craft §3.1, `kvclient.types.VariantStats`) -----------------

    def _stats_init(self) -> None:
        self.fresh_kv: dict[int, list[tuple[Tensor, Tensor]]] = {s: [] for s in self.fresh}
        self.inter: dict[int, Tensor] = {}  # s -> [|C_s|, s] sum over layers of mass to prefix chunks
        self.intra: dict[int, float] = {s: 0.0 for s in self.fresh}

    def record_stats(self, rows: Tensor, k_raw: Tensor, v: Tensor, mass: Tensor) -> list[float]:
        """Accumulate fresh chunks' KV and stats; return this layer's inter(C_i, U) per chunk."""
        for s in self.fresh:  # every row of a fresh chunk is computed at every layer
            idx = torch.searchsorted(rows, self.lay.rows(s))
            self.fresh_kv[s].append((k_raw[:, idx].clone(), v[:, idx].clone()))
            m = mass[idx]  # [|C_s|, S]
            self.inter[s] = self.inter.get(s, 0) + m[:, :s]  # eq. 3 per token and prefix chunk
            self.intra[s] += float(m[:, s].sum())  # eq. 4
        q = torch.searchsorted(rows, self.asker)
        return [float(mass[q, s].sum()) for s in self.lay.chunk_indices()]

    def fresh_chunks(self) -> dict[int, FreshChunk]:
        out = {}
        for s in self.fresh:
            t = len(self.lay.segments[s].tokens)
            inter = self.inter[s]  # [t, s]
            per_chunk = inter.sum(0) / (self.L * t)  # eq. 9-10, one per prefix chunk
            out[s] = FreshChunk(
                prefix=self.lay.keys[:s],
                kv=self.fresh_kv[s],
                stats=VariantStats(
                    a=float(per_chunk.sum()),
                    b=self.intra[s] / (self.L * t),
                    prefix_attention=tuple(float(x) for x in per_chunk),
                    token_inter_attention=tuple(float(x) for x in inter.sum(1)),  # eq. 14 input
                ),
            )
        return out
