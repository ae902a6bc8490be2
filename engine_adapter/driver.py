"""The per-layer loop of a blended prefill (no reuse gate: `blend.blend_prefill` asks it first).

Per layer l (docs/adapter.md; Cache-Craft §3.4.3; CacheBlend §4):
  1. wait for layer l of the reused chunks, until a deadline (`layer_budget_s`);
  2. merge their RoPE-free K/V into one cache [Hkv, N, D] and rotate all of it to the
     prompt's positions in one batched op (cos/sin tables computed once per prompt);
  3. Q/K/V for the computed rows only (fresh chunks, the question, the recompute set);
  4. scatter the computed K/V into the merged cache, attention of the computed rows
     over it (fused SDPA, position-causal mask); attention mass per segment only for
     the rows that need it: fresh chunks (their variant statistics) and, while
     Cache-Craft Alg. 1 is deciding, the question;
  5. o-proj + MLP for the computed rows; choose the rows of layer l+1 (focused-chunk
     early termination). The last prompt row is always computed.
  HKVD (CacheBlend) selects between 3 and 4: of the rows whose K/V were just computed,
  only the highest-deviation ones run attention + MLP on.
After the last layer: logits of the last prompt row only (all rows on request).

A reused chunk whose layer l is absent (late, missing, corrupt) is computed from then on.
Its rows need hidden states at layer l, which were never computed, so the driver
catches them up: it runs those rows through layers 0..l-1 over the merged cache
(overwriting the chunk's K/V there), then they join the computed rows at layer l.
Correct first; it costs l layers of that chunk, logged once per event.

The driver, not the engine, applies RoPE, with the parameters of the engine's
`ModelSpec` (what stored caches are keyed by).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeVar

import torch
from torch import Tensor

from engine_adapter.llama import LlamaEngine, rope_for_spec
from engine_adapter.policy import FocusTracker, ReusePolicy
from engine_adapter.prompt import Layout
from engine_adapter.source import LayerKV, LayerSource
from kvcraft.records import VariantStats
from kvkernels import attention_mass, kv_deviation_topk, rope_tables, rotate

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class LayerTiming:
    wait_s: float  # blocked in LayerSource.wait_layer
    compute_s: float  # everything else of the layer, catch-up included
    rotate_s: float = 0.0  # of compute_s: merging the stored K/V and re-rotating K
    attend_s: float = 0.0  # of compute_s: attention (and mass) of the computed rows


@dataclass(frozen=True)
class FreshChunk:
    """A chunk computed at every layer in this prompt: a new variant to store."""

    prefix: tuple[str, ...]  # keys of the chunks before it (the variant's prefix)
    kv: list[tuple[Tensor, Tensor]]  # per layer (K RoPE-free [Hkv,T,D], V [Hkv,T,D])
    stats: VariantStats


@dataclass(frozen=True)
class Layer0:
    """Rows computed through layer 0 by an earlier pass over the same stored KV."""

    rows: Tensor  # [R] sorted prompt rows
    h: Tensor  # [R, d] their hidden states after layer 0
    k: Tensor  # [Hkv, R, D] their layer-0 K (post-RoPE)
    v: Tensor  # [Hkv, R, D]


@dataclass
class BlendResult:
    logits: Tensor  # [V] at the last prompt position
    kv: list[tuple[Tensor, Tensor]]  # per layer merged (K post-RoPE [Hkv,N,D], V), ready for decode
    reuse: bool  # False: served without stored KV (policy full, no cached chunk, or the reuse gate said no)
    timings: list[LayerTiming] = field(default_factory=list)  # per layer; empty when served by engine.prefill
    computed_rows: list[int] = field(default_factory=list)  # rows computed per layer
    recomputed_rows: list[int] = field(default_factory=list)  # of those, rows of reused chunks
    reused_tokens: int = 0  # tokens of the chunks served from stored KV
    # Segment indices whose stored KV served the prefill to its end: the policy's reused
    # chunks (none with policy full, or when served by engine.prefill) less those that
    # fell back (computed from the start, `fallbacks`).
    reused_segments: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    fresh: dict[int, FreshChunk] = field(default_factory=dict)  # segment index -> new variant
    fallbacks: list[tuple[int, int]] = field(default_factory=list)  # (chunk, layer) computed instead
    focused: frozenset[int] | None = None  # Alg. 1 F* (segment indices), if decided
    focus_layer: int | None = None  # Alg. 1 L* (0-based), if decided
    logits_s: float = 0.0  # final norm + vocabulary projection
    rows: Tensor | None = None  # rows computed at the last layer (with all_logits)
    row_logits: Tensor | None = None  # [len(rows), V] (with all_logits)

    @property
    def recompute_ratio(self) -> float:
        """Fraction of reused token-layers whose KV was recomputed (layer 0 included)."""
        if not self.reused_tokens or not self.recomputed_rows:
            return 0.0
        return sum(self.recomputed_rows) / (self.reused_tokens * len(self.recomputed_rows))

    @property
    def computed_share(self) -> float:
        """Fraction of the prompt's row-layers computed (every layer, question included):
        what sets the compute of a prefill; 1 / this is its ideal speed-up."""
        if not self.prompt_tokens or not self.computed_rows:
            return 1.0
        return sum(self.computed_rows) / (self.prompt_tokens * len(self.computed_rows))


@torch.no_grad()
def run_blend(engine: LlamaEngine, lay: Layout, policy: ReusePolicy, source: LayerSource,
              reused: Sequence[int], all_logits: bool = False, stats: bool = True,
              carry: Layer0 | None = None) -> BlendResult:
    """The loop, trusted: no reuse probe is asked here. stats=False: no new variants are
    wanted (nothing will be stored), so fresh chunks get no KV copies and no attention mass.
    carry: rows whose layer 0 is already computed (`_Blend.run`)."""
    return _Blend(engine, lay, policy, source, list(reused), stats).run(all_logits, carry=carry)


class _Blend:
    """State of one blended prefill; `run` is the per-layer loop."""

    def __init__(self, engine: LlamaEngine, lay: Layout, policy: ReusePolicy,
                 source: LayerSource, reused: list[int], stats: bool = True):
        c = engine.cfg
        self.e, self.lay, self.policy, self.source = engine, lay, policy, source
        self.L, self.n = c.num_layers, lay.n
        self.hkv, self.hd = c.num_kv_heads, c.head_dim
        self.pos = torch.arange(self.n)  # [N]
        self.cos, self.sin = rope_tables(rope_for_spec(engine.model_spec()), self.pos)  # [N, D/2] each
        self.live = list(reused)  # reused chunks still served from the cache
        self.reused_mask = torch.zeros(self.n, dtype=torch.bool)  # [N] rows of reused chunks
        for s in reused:
            self.reused_mask[lay.span(s)] = True
        self.live_mask = self.reused_mask.clone()  # [N] rows still served from the cache
        self.live_mask[-1] = False  # the last row is always computed
        self.reused_tokens = int(self.reused_mask.sum())
        self.fresh = [s for s, seg in enumerate(lay.segments)
                      if stats and not seg.question and s not in reused]  # new variants to return
        self.fresh_mask = torch.zeros(self.n, dtype=torch.bool)  # rows whose mass feeds statistics
        for s in self.fresh:
            self.fresh_mask[lay.span(s)] = True
        self.asker = (lay.rows(len(lay.segments) - 1) if lay.segments[-1].question
                      else torch.tensor([self.n - 1]))  # rows whose attention defines inter(C_i, U)
        self.asker_mask = torch.zeros(self.n, dtype=torch.bool)
        self.asker_mask[self.asker] = True
        self.chunks = torch.tensor(lay.chunk_indices(), dtype=torch.long)
        self.focus = FocusTracker(lay.chunk_indices(), policy.focus_window)
        self.blank = torch.zeros(self.hkv, self.n, self.hd, dtype=engine.dtype)  # rows not served
        self.kv: list[tuple[Tensor, Tensor]] = []
        self.res = BlendResult(logits=torch.empty(0), kv=self.kv, reuse=bool(reused),
                               reused_tokens=self.reused_tokens, prompt_tokens=self.n)
        self._stats_init()

    # ---- rows -------------------------------------------------------------------

    def initial_rows(self) -> Tensor:
        want = ~self.reused_mask
        want[-1] = True  # the last prompt token is always computed
        for s in self.live:
            first = torch.as_tensor(self.policy.first_rows(self.lay, s), dtype=torch.long)
            want[self.lay.edges[s] + first] = True
        return want.nonzero().squeeze(1)

    # ---- the loop ---------------------------------------------------------------

    def run(self, all_logits: bool, depth: int | None = None, carry: "Layer0 | None" = None) -> BlendResult:
        """depth: stop after that many layers (no logits then). carry: rows whose layer 0 an
        earlier pass over the same stored KV computed: they join at layer 1."""
        e, lay = self.e, self.lay
        rows = self.initial_rows()  # [R] sorted
        if carry is not None:
            rows = rows[~torch.isin(rows, carry.rows)]
        h = e.embed(lay.tokens[rows])  # [R, d]
        for layer in range(self.L if depth is None else depth):
            t0 = time.perf_counter()
            got = self.wait(layer)
            t1 = time.perf_counter()
            rows, h = self.fall_back(layer, got, rows, h)
            t2 = time.perf_counter()
            self.kv.append(self.merged(got))
            if layer == 0 and carry is not None:  # before the attention: these rows are keys too
                self.kv[0][0][:, carry.rows], self.kv[0][1][:, carry.rows] = carry.k, carry.v
            t3 = time.perf_counter()
            rows, h, k_raw, v, mass = self.layer(layer, rows, h)
            to_question = self.record_stats(rows, k_raw, v, mass)
            self.res.computed_rows.append(len(rows))
            self._recomputed.append(self.per_rows("recomputed", rows, lambda: self.reused_mask[rows].sum()))
            keep = self.continuing(layer, rows, to_question)
            if keep is not None:
                rows, h = rows[keep], h[keep]
            if layer == 0 and carry is not None:
                rows, order = torch.cat([rows, carry.rows]).sort()
                h = torch.cat([h, carry.h])[order]
            t4 = time.perf_counter()
            self.res.timings.append(LayerTiming(wait_s=t1 - t0, compute_s=t4 - t1, rotate_s=t3 - t2,
                                                attend_s=self._attend_s))
        self.res.recomputed_rows = torch.stack(self._recomputed).tolist() if self._recomputed else []
        if depth is not None and depth < self.L:
            self.res.reused_segments = list(self.live)
            return self.res
        t5 = time.perf_counter()
        logits = e.logits(h if all_logits else h[-1:])  # rows[-1] is the last prompt row
        self.res.logits = logits[-1]
        self.res.logits_s = time.perf_counter() - t5
        if all_logits:
            self.res.rows, self.res.row_logits = rows, logits
        self.res.fresh = self.fresh_chunks()
        self.res.reused_segments = list(self.live)
        self.res.focused, self.res.focus_layer = self.focus.focused, self.focus.layer
        return self.res

    def merged(self, got: LayerKV) -> tuple[Tensor, Tensor]:
        """The merged cache of one layer: stored K/V of live chunks at their spans (K rotated
        to the prompt's positions), zeros elsewhere until the computed rows are scattered in."""
        if not self.live:
            return self.blank.clone(), self.blank.clone()
        segs = range(len(self.lay.segments))
        spans = [self.lay.span(s) for s in segs]
        K = torch.cat([got[s][0] if s in got else self.blank[:, spans[s]] for s in segs], dim=1)  # [Hkv, N, D]
        V = torch.cat([got[s][1] if s in got else self.blank[:, spans[s]] for s in segs], dim=1)
        return rotate(K, self.cos, self.sin), V

    def layer(self, layer: int, rows: Tensor, h: Tensor, select: bool = True
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        """One layer: K/V of `rows` into the merged cache, then attention + MLP for those
        of them that stay (all, except where HKVD selects at this layer).

        Returns the rows that ran the layer, their hidden states, pre-RoPE k, v and the
        attention mass [M, S] of the rows among them that need it (None if none do).
        """
        e, (K, V) = self.e, self.kv[layer]
        qk, v = e.qk_v(layer, h)  # [Hq+Hkv,R,D] pre-RoPE, [Hkv,R,D]
        k = qk[e.cfg.num_heads:]  # pre-RoPE: what a fresh chunk's variant stores
        q, k_rot = e.rotated_qk(qk, *self.per_rows("tables", rows, lambda: (self.cos[rows], self.sin[rows])))
        keep = self.hkvd_keep(layer, rows, k_rot, v) if select else None
        # Every computed K/V goes in, selected or not: it came from right hidden states.
        K[:, rows] = k_rot
        V[:, rows] = v
        if keep is not None:
            rows, h, q, k, v = rows[keep], h[keep], q[:, keep], k[:, keep], v[:, keep]
        t0 = time.perf_counter()
        self.q = q  # the rotated queries of the rows that ran this layer (the question pass reads them)
        o, _ = e.attend(q, rows, K, V, self.pos)
        mass = None
        if select and (self.fresh or self.focus.active):
            need = self.fresh_mask | self.asker_mask if self.focus.active else self.fresh_mask
            m = need[rows]
            # Rows of fresh chunks run every layer: with one, some row needs mass without
            # asking the device (a read of it waits for the GPU).
            if self.fresh or bool(m.any()):
                mass = attention_mass(q[:, m], rows[m], K, self.pos, self.lay.bounds, scale=e.scale)
        self._attend_s = time.perf_counter() - t0
        return rows, e.mlp(layer, e.attn_out(layer, h, o)), k, v, mass

    def per_rows(self, what: str, rows: Tensor, make: Callable[[], T]) -> T:
        """`make()`, made again only when `rows` is another tensor: the loop keeps one rows
        tensor layer after layer until a policy drops some or a chunk falls back, and on a GPU
        each derived tensor is a launch, each read of one a wait. (The memo holds the rows it
        was made for, so no other tensor can take its identity.)"""
        hit = self._per_rows.get(what)
        if hit is None or hit[0] is not rows:
            hit = self._per_rows[what] = (rows, make())
        return hit[1]

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
        self.live_mask[new] = False
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

    def hkvd_keep(self, layer: int, rows: Tensor, k_rot: Tensor, v: Tensor) -> Tensor | None:
        """CacheBlend §4.3 gradual filtering: which of `rows` run this layer (bool mask;
        None: all of them).

        Among the reused rows still computed, keep the share `hkvd_share` of the reused
        tokens with the highest deviation between this layer's K/V from the current
        hidden states (k_rot, v) and the stored K/V (both K at the new positions).
        Called before the scatter, so the merged cache still holds the stored K/V.
        """
        share = self.policy.hkvd_share(layer, self.L)
        if share is None:
            return None
        cand = self.live_mask[rows].nonzero().squeeze(1)  # indices into rows
        if not len(cand):
            return None
        K, V = self.kv[layer]
        want = share * self.reused_tokens / len(cand)
        at = rows[cand]
        _, top = kv_deviation_topk(k_rot[:, cand], v[:, cand], K[:, at], V[:, at], min(1.0, want))
        keep = torch.ones(len(rows), dtype=torch.bool)
        keep[cand] = False
        keep[cand[top]] = True
        return keep

    def continuing(self, layer: int, rows: Tensor, to_question: Tensor | None) -> Tensor | None:
        """Which of `rows` run layer+1 (bool mask; None: all of them)."""
        return self.focus_keep(layer, rows, to_question)

    def focus_keep(self, layer: int, rows: Tensor, to_question: Tensor | None) -> Tensor | None:
        """Cache-Craft Alg. 1: which of `rows` continue to layer+1 (bool mask; None: all);
        to_question: inter(C_i, U) of this layer per chunk."""
        if to_question is None:
            return None
        focused = self.focus.update(layer, to_question.tolist())
        if focused is None:
            return None
        # Stop recomputing tokens of unfocused reused chunks.
        unfocused = torch.zeros(self.n, dtype=torch.bool)
        for s in self.live:
            if s not in focused:
                unfocused[self.lay.span(s)] = True
        return ~(unfocused & self.live_mask)[rows]

    # ---- statistics (Cache-Craft §3.1, `kvcraft.records.VariantStats`) -----------------

    def _stats_init(self) -> None:
        self._attend_s = 0.0
        self._recomputed: list[Tensor] = []  # per layer, rows of reused chunks computed (0-d; read at the end)
        self._per_rows: dict[str, tuple[Tensor, object]] = {}  # `per_rows`: what -> (rows, made)
        self.q: Tensor | None = None  # set by `layer`
        self.fresh_kv: dict[int, list[tuple[Tensor, Tensor]]] = {s: [] for s in self.fresh}
        self.inter: dict[int, Tensor] = {}  # s -> [|C_s|, s] sum over layers of mass to prefix chunks
        self.intra: dict[int, float] = {s: 0.0 for s in self.fresh}

    def record_stats(self, rows: Tensor, k_raw: Tensor, v: Tensor, mass: Tensor | None) -> Tensor | None:
        """Accumulate fresh chunks' KV and stats; return this layer's inter(C_i, U) per chunk
        while Alg. 1 is deciding (None otherwise)."""
        if mass is None:
            return None
        need = self.fresh_mask | self.asker_mask if self.focus.active else self.fresh_mask
        mass_rows = rows[need[rows]]  # the rows `mass` belongs to, in order
        for s in self.fresh:  # every row of a fresh chunk is computed at every layer
            idx = torch.searchsorted(rows, self.lay.rows(s))
            self.fresh_kv[s].append((k_raw[:, idx].clone(), v[:, idx].clone()))
            m = mass[torch.searchsorted(mass_rows, self.lay.rows(s))]  # [|C_s|, S]
            self.inter[s] = self.inter.get(s, 0) + m[:, :s]  # eq. 3 per token and prefix chunk
            self.intra[s] += float(m[:, s].sum())  # eq. 4
        if not self.focus.active:
            return None
        q = torch.searchsorted(mass_rows, self.asker)
        return mass[q][:, self.chunks].sum(0)  # [chunks]

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
