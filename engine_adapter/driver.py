"""The per-layer loop of a blended prefill (no reuse gate: `blend.blend_prefill` asks it first).

Before the first layer (docs/adapter.md, "One layer step"): the computed rows, everything
derived from them (their RoPE tables, the position-causal mask in runs of rows, HKVD's
candidates) and one buffer for a layer's K before its rotation. Then per layer l, one step
(`_Blend.step`; Cache-Craft §3.4.3; CacheBlend §4), whatever the policy:
  1. wait for layer l of the reused chunks, until a deadline (`layer_budget_s`);
  2. Q/K/V for the computed rows only (fresh chunks, the question, the recompute set);
  3. the merged cache [Hkv, N, D]: the stored RoPE-free K/V of the live chunks, in prompt
     order with zeros between them, in one concatenation; the computed rows' pre-RoPE K/V
     written over their rows in one indexed copy; then K rotated to the prompt's positions
     in one batched op (cos/sin tables computed once per prompt). With the engine's Triton
     kernels (CUDA) the stored K is rotated alone and one launch rotates the rows' q and k
     and writes their K/V over their rows (`kvkernels.layer.rope_write`);
  4. the selections' `select` (the hook, `Selection`): which of the rows whose K/V were
     just computed attend and run the MLP. CacheBlend's `Hkvd` (§4.3), at its filter layers
     only: the highest-deviation ones, a count known from the layout (a top-k on the
     device, no read of it); the default's question phase (`query.QuestionPhase`);
  5. attention of the computed rows over the merged cache (Triton: the kernel, masking
     by position, which returns the attention mass per segment in the same launch where
     rows need it; CPU: fused SDPA in a fixed number of runs of rows, each over the keys up
     to its last row, with the position-causal mask built once per set of rows, `RowBlocks`:
     on the CPU, where the rows are HKVD's, that set is read from memory once per choice);
     attention mass per segment only for the rows that
     need it: fresh chunks (their variant statistics) and, while Cache-Craft Alg. 1 is
     deciding, the question;
  6. o-proj + MLP for the computed rows; the selections' `next`, the rows of layer l+1
     (`Focus`: Alg. 1's focused-chunk early termination, off by default; the default's
     chunk-head rows, `query.HeadStop`). The last prompt row is always computed.
Within a layer nothing reads a device value on the host (on the CPU, the runs of HKVD's
rows read them, once per choice: memory there, no device), and the operations dispatched per
layer do not depend on the number of chunks or rows (tests/engine_adapter/test_op_count.py);
what changes the rows (HKVD's filter layers, Alg. 1 once it decides, a fallback) rebuilds
what derives from them once, not per layer.
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
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from engine_adapter.graphs import Caches, StaticStep, StepFailed
from engine_adapter.llama import LlamaEngine, RowBlocks, rope_for_spec
from engine_adapter.policy import FocusTracker, ReusePolicy
from engine_adapter.prompt import Layout
from engine_adapter.source import LayerKV, LayerSource
from kvcraft.records import VariantStats
from kvkernels import (KeyReads, attention_mass, kv_deviation_topk, rope_tables, rotate_triton,
                       selective_attention_triton)
from kvkernels.layer import rope_write_triton
from kvkernels.deviation import num_selected

log = logging.getLogger(__name__)

# A layer's merge (`_Blend.merged`, `_Blend.written`): rows p, their pre-RoPE q/k/v heads
# [Hq+2Hkv, R, D] and its k and v views -> (their q rotated if the merge rotated it, else
# None; the layer's K post-RoPE, V).
Merge = Callable[["_Rows", Tensor, Tensor, Tensor], tuple[Tensor | None, Tensor, Tensor]]


@dataclass(frozen=True)
class LayerTiming:
    wait_s: float  # blocked in LayerSource.wait_layer
    compute_s: float  # everything else of the layer, catch-up included
    rotate_s: float = 0.0  # of compute_s: merging the stored K/V and re-rotating K
    attend_s: float = 0.0  # of compute_s: attention (and mass) of the computed rows
    static: bool = False  # ran as the engine's static step (`graphs`; its attention not timed apart: 0);
    # the default policy's two passes: either of them


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
    k: Tensor  # [Hkv, R, D] their layer-0 K (RoPE-free: the merge rotates it with the rest)
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
              carry: Layer0 | None = None, selections: Sequence["Selection"] | None = None) -> BlendResult:
    """The loop, trusted: no reuse probe is asked here. stats=False: no new variants are
    wanted (nothing will be stored), so fresh chunks get no KV copies and no attention mass.
    carry: rows whose layer 0 is already computed (`_Blend.run`). selections: the choice of
    rows (`Selection`); None: the policy's (`policy_selections`)."""
    return _Blend(engine, lay, policy, source, list(reused), stats, selections).run(all_logits, carry=carry)


class _Rotation:
    """RoPE tables of some positions, laid out to rotate rows at those positions in one op.

    `triton` (the engine's kernels): `kvkernels.rotate_triton` (one launch) with the [T, D/2]
    cos and sin tables. Else the arithmetic of `kvkernels.rotate_reference` (x1 cos - x2 sin,
    x2 cos + x1 sin in fp32, rounded once), bit for bit, in four operations instead of its
    nine: x [cos, cos] + roll(x, D/2) [-sin, sin] (x2 (-sin) is -(x2 sin) exactly, a + -b is a - b)."""

    def __init__(self, tables: tuple[Tensor, Tensor], triton: bool):
        self.tables = tables  # triton: cos, sin [T, D/2]; else [cos, cos], [-sin, sin] [T, D]
        self.triton = triton

    @classmethod
    def of(cls, cos: Tensor, sin: Tensor, triton: bool) -> "_Rotation":
        if triton:
            return cls((cos, sin), True)
        return cls((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), False)

    def at(self, idx: Tensor) -> "_Rotation":
        """The tables of rows `idx` of these."""
        return _Rotation((self.tables[0].index_select(0, idx), self.tables[1].index_select(0, idx)), self.triton)

    def __call__(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """x [H, T, D] rotated (T = the tables' rows), into `out` if given."""
        a, b = self.tables
        if self.triton:
            r = rotate_triton(x, a, b)
            return r if out is None else out.copy_(r)
        xf = x.float()
        turned = xf.roll(xf.shape[-1] // 2, -1).mul_(b)
        if out is not None and out.dtype == torch.float32:
            return torch.mul(xf, a, out=out).add_(turned)
        r = torch.mul(xf, a).add_(turned).to(x.dtype)
        return r if out is None else out.copy_(r)


@dataclass
class _Rows:
    """One set of computed rows and what the layer step derives from it, made once per set
    (at the start, and where a policy changes the set), never per layer."""

    rows: Tensor  # [R] sorted prompt rows
    host: tuple[int, ...] | None  # the same rows on the host, where known without a read of the device
    prompt_rot: _Rotation  # RoPE tables of the prompt's positions (`rot`: at the rows)
    mask: Tensor | RowBlocks | None  # CPU: the position-causal mask, in runs or [R, N] whole; None: CUDA,
    # or every row in order (causal)
    cand: Tensor  # [C] indices into `rows` of the rows still served from stored KV (HKVD's candidates)
    n_cand: int  # C
    others: Tensor  # the rows that are not candidates (prompt rows, sorted)
    recomputed: int  # rows of reused chunks among the rows
    _memo: dict[str, Any] = field(default_factory=dict)

    def memo(self, what: str, make: Callable[[], Any]) -> Any:
        """`make()` once for this set of rows (what one policy derives from them besides)."""
        if what not in self._memo:
            self._memo[what] = make()
        return self._memo[what]

    @property
    def rot(self) -> _Rotation:
        """RoPE tables at the rows, made at their first use (a static step makes its own)."""
        return self.memo("rot", lambda: self.prompt_rot.at(self.rows))


@dataclass
class Stepped:
    """What one layer step made (`_Blend.step`)."""

    rows: _Rows  # the rows that ran the layer (after the selections' `select`)
    h: Tensor  # [R, d] their hidden states after it
    q: Tensor  # [Hq, R, D] their queries, rotated
    k: Tensor  # [Hkv, R', D] pre-RoPE k of the computed rows: those that ran the layer where fresh
    v: Tensor  # chunks want them (`record_stats`), else every row whose K/V the layer wrote
    mass: Tensor | None  # [M, S] attention mass per segment of the rows that need it (None: none do)


class Selection:
    """The layer step's one hook: a policy's choice of rows (docs/adapter.md, "The select hook").

    The loop (`_Blend.run`) asks its selections, in order: `prepare` once, before anything
    is derived from the rows; `first`, the rows that run layer 0 (given those of the policy's
    recompute lists); then per layer `acts` (will `select` change the rows in this layer? a
    layer where none does may run as a static step, `graphs`), `compares` (will `select`
    read the candidates' stored K/V? the merge keeps them aside), where it acts `select`
    once the computed rows' K/V are in the layer's cache (which of them attend and run the
    MLP: the new rows and the indices kept into the old ones, None where unchanged) or, where
    it chooses by KV deviation (`keeps`), the static step's choice and then `measured`, and
    `reads_into` (where the attention should add up what the rows read of each key); then
    `observe` once the layer ran, and `next` (the rows that run layer+1, with their hidden
    states); `finish` once the loop ends. A selection makes rows with `_Blend.rows_of` or
    `_Blend.kept`, which derive their tables once per set of rows. Each default changes
    nothing. Plug-ins: `Hkvd` (CacheBlend), `Focus` (Cache-Craft Alg. 1), and the default
    policy's `query.QuestionPhase` and `query.HeadStop`."""

    def prepare(self, b: "_Blend") -> None:
        pass

    def first(self, b: "_Blend", rows: list[int]) -> list[int]:
        return rows

    def acts(self, b: "_Blend", layer: int) -> bool:
        return self.compares(b, layer)

    def compares(self, b: "_Blend", layer: int) -> bool:
        return False

    def select(self, b: "_Blend", layer: int, p: _Rows, K: Tensor, V: Tensor) -> tuple[_Rows, Tensor | None]:
        return p, None

    def keeps(self, b: "_Blend", layer: int, p: _Rows) -> int | None:
        """Where `select` keeps every row of p that is not a candidate and the candidates whose
        K/V just computed deviate most from their stored K/V (CacheBlend §4.1's deviation,
        ties to the earlier row): how many candidates it keeps. The layer may then run as a
        static step that chooses them on the device (`graphs.SelectStep`), and `measured` gets
        their deviation. None (the default): `select` runs in the eager step."""
        return None

    def measured(self, b: "_Blend", layer: int, p: _Rows, deviation: Tensor) -> None:
        """The deviation [C] of p's candidates (`p.cand`) where the layer ran as a static step
        that chose them (`keeps`)."""

    def reads_into(self, b: "_Blend", layer: int, p: _Rows) -> KeyReads | None:
        """Where this layer's attention adds up how much rows p (those that attend, after
        `select`) read each key, summed over rows and heads: only on the engine's Triton path,
        inside the attention's own launch (`kvkernels.KeyReads`). None: not wanted."""
        return None

    def observe(self, b: "_Blend", layer: int, out: Stepped) -> None:
        pass

    def next(self, b: "_Blend", layer: int, p: _Rows, h: Tensor) -> tuple[_Rows, Tensor]:
        return p, h

    def finish(self, b: "_Blend") -> None:
        """Once the last layer ran (inside the prefill's lease of the static steps, whose
        buffers the next prefill reuses: what a selection keeps of them, it copies here)."""


class Hkvd(Selection):
    """CacheBlend §4.3 gradual filtering, at the layers where `policy.hkvd_share` says so:
    which of the computed rows run the layer.

    Among the reused rows still computed, keep the share `hkvd_share` of the reused tokens
    with the highest deviation between this layer's K/V from the current hidden states (in
    the merged cache now) and the stored K/V (both K at the new positions). How many stay is
    known from the layout; which, only on the device (a top-k there)."""

    def compares(self, b: "_Blend", layer: int) -> bool:
        return b.policy.hkvd_share(layer, b.L) is not None

    def _share(self, b: "_Blend", layer: int, p: _Rows) -> float:
        """The share of p's candidates kept at `layer`."""
        share = b.policy.hkvd_share(layer, b.L)
        return 1.0 if share is None or not p.n_cand else min(1.0, share * b.reused_tokens / p.n_cand)

    def keeps(self, b: "_Blend", layer: int, p: _Rows) -> int:
        return num_selected(self._share(b, layer, p), p.n_cand)

    def select(self, b: "_Blend", layer: int, p: _Rows, K: Tensor, V: Tensor) -> tuple[_Rows, Tensor | None]:
        want = self._share(b, layer, p)
        n = num_selected(want, p.n_cand)
        if n == p.n_cand:
            return p, None
        at, k_old, v_old = b.stored  # [C] prompt rows, their stored K (RoPE-free) and V (`merged`)
        _, top = kv_deviation_topk(K.index_select(1, at), V.index_select(1, at), b.rot.at(at)(k_old), v_old,
                                   want)  # [n] sorted
        chosen = at.index_select(0, top)
        rows = torch.cat((p.others, chosen)).sort().values
        q = b.rows_of(rows=rows, cand=torch.searchsorted(rows, chosen), n_cand=n, others=p.others,
                      recomputed=p.recomputed - p.n_cand + n)
        return q, torch.searchsorted(p.rows, rows)


class Focus(Selection):
    """Cache-Craft Alg. 1's early termination (`focus_window` > 0): once the loop's
    `FocusTracker` decides the focused chunks F* at layer L* (from the question's attention
    to each chunk, eq. 15), the reused chunks out of focus stop recomputing their tokens."""

    def next(self, b: "_Blend", layer: int, p: _Rows, h: Tensor) -> tuple[_Rows, Tensor]:
        if b.focus.focused is None or b.focus.layer != layer:
            return p, h
        unfocused = [False] * b.n
        for s in b.live:
            if s not in b.focus.focused:
                unfocused[b.lay.span(s)] = [True] * len(b.lay.segments[s].tokens)
        host = b.host_rows(p)
        return b.kept(p, h, [i for i, r in enumerate(host) if not (unfocused[r] and b.live_host[r])])


def policy_selections() -> list[Selection]:
    """What every policy's loop selects with; each acts only where its policy asks
    (`hkvd_share`, `focus_window`)."""
    return [Hkvd(), Focus()]


class _Blend:
    """State of one blended prefill; `run` is the per-layer loop, `step` one layer of it,
    `selections` the choice of its rows (`Selection`)."""

    def __init__(self, engine: LlamaEngine, lay: Layout, policy: ReusePolicy,
                 source: LayerSource, reused: list[int], stats: bool = True,
                 selections: Sequence[Selection] | None = None,
                 caches: Mapping[int, tuple[Tensor, Tensor]] | None = None):
        c = engine.cfg
        self.e, self.lay, self.policy, self.source = engine, lay, policy, source
        self.L, self.n = c.num_layers, lay.n
        self.hkv, self.hd = c.num_kv_heads, c.head_dim
        self.pos = torch.arange(self.n)  # [N] key positions
        self.causal = True  # the keys sit at their prompt positions (`query.QuestionPhase` moves some)
        self.runs = True  # CPU attention in runs of rows (`RowBlocks`); False: one call over every key
        self.rot = _Rotation.of(*rope_tables(rope_for_spec(engine.model_spec()), self.pos),
                                engine.triton)  # [N] tables
        self.live = list(reused)  # reused chunks still served from the cache
        # Row sets on the host (spans are `Layout.edges`, ints): tensors made from them once.
        self.reused_host = [False] * self.n  # rows of reused chunks
        for s in reused:
            self.reused_host[lay.span(s)] = [True] * len(lay.segments[s].tokens)
        self.live_host = list(self.reused_host)  # rows still served from the cache
        self.live_host[-1] = False  # the last row is always computed
        self.reused_mask = torch.tensor(self.reused_host)  # [N]
        self.live_mask = torch.tensor(self.live_host)  # [N]
        self.reused_tokens = sum(self.reused_host)
        self.fresh = [s for s, seg in enumerate(lay.segments)
                      if stats and not seg.question and s not in reused]  # new variants to return
        self.asker_host = (list(range(*lay.edges[-2:])) if lay.segments[-1].question
                           else [self.n - 1])  # rows whose attention defines inter(C_i, U)
        self.asker = torch.tensor(self.asker_host)
        self.asker_mask = torch.zeros(self.n, dtype=torch.bool).index_fill_(0, self.asker, True)
        self.chunks = torch.tensor(lay.chunk_indices(), dtype=torch.long)
        self.focus = FocusTracker(lay.chunk_indices(), policy.focus_window)
        self._zeros = torch.zeros(self.hkv, self.n, self.hd, dtype=engine.dtype)  # rows neither stored nor computed
        self.kv: list[tuple[Tensor, Tensor]] = []
        self.res = BlendResult(logits=torch.empty(0), kv=self.kv, reuse=bool(reused),
                               reused_tokens=self.reused_tokens, prompt_tokens=self.n)
        self._live_changed()
        self._stats_init()
        # Layer -> a merged cache (K post-RoPE, V) an earlier phase made over the same stored KV,
        # every row it computed at that layer among this phase's: the step writes its rows
        # over it instead of merging the layer again (`merging`); it becomes this phase's.
        self.caches = dict(caches or {})
        self.selections = policy_selections() if selections is None else list(selections)
        self.leased = False  # the engine's static steps, for this prefill (`run`)
        self._static_in: tuple[StaticStep, _Rows, Tensor] | None = None  # the rows a static step has loaded
        self._static_cc: Caches | None = None  # the bucket's caches the static steps wrote
        self._static_layers: list[int] = []
        self._keys_placed = False  # the bucket's key positions and segments are this prefill's (`static_step`)
        self._segments = 0  # S' of the bucket's segments (`graphs.Caches.segments_of`), 0: no mass wanted

    def _live_changed(self) -> None:
        """`pieces`: the prompt in order as a layer's merge concatenates it, a live chunk's index
        (its stored K/V) or zeros for a run of rows not stored (views made here, not per layer)."""
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
        """A layer's K and V as its merge concatenates them (`pieces`): the live chunks' stored
        K/V that arrived (`got`) and zeros between them, in prompt order."""
        k = [got[x][0] if isinstance(x, int) else x for x in self.pieces]
        v = [got[x][1] if isinstance(x, int) else x for x in self.pieces]
        return k, v

    # ---- rows -------------------------------------------------------------------

    def initial_rows(self) -> list[int]:
        want = [not r for r in self.reused_host]
        want[-1] = True  # the last prompt token is always computed
        for s in self.live:
            for i in self.policy.first_rows(self.lay, s):
                want[self.lay.edges[s] + i] = True
        rows = [i for i, w in enumerate(want) if w]
        for sel in self.selections:
            rows = sel.first(self, rows)
        return rows

    def rows_of(self, host: Sequence[int] | None = None, *, rows: Tensor | None = None,
                cand: Tensor | None = None, n_cand: int = 0, others: Tensor | None = None,
                recomputed: int = 0) -> _Rows:
        """What the step derives from a set of rows: from the host's `host` (sorted), or from
        a device tensor `rows` with its candidates and counts (HKVD's choice)."""
        if host is not None:
            host = tuple(host)
            rows = torch.tensor(host, dtype=torch.long)
            cand_h = [i for i, r in enumerate(host) if self.live_host[r]]
            cand, n_cand = torch.tensor(cand_h, dtype=torch.long), len(cand_h)
            others = torch.tensor([r for r in host if not self.live_host[r]], dtype=torch.long)
            recomputed = sum(self.reused_host[r] for r in host)
        assert rows is not None and cand is not None and others is not None
        return _Rows(rows, host, self.rot, self._mask(rows, host), cand, n_cand, others, recomputed)

    def _mask(self, rows: Tensor, host: tuple[int, ...] | None) -> Tensor | RowBlocks | None:
        """The position-causal mask of `rows` over every key, in runs (`RowBlocks`; CPU: the
        Triton kernel masks by position itself): key j visible to row r iff pos[j] <= pos[r],
        which every computed row's own key is, so no row sees nothing. None where causal SDPA
        is exact. A run reads the keys up to its last row: a computed row sits at its prompt
        position and no key sits before its own (the question pass moves keys past the end),
        so no key past row r is visible to it. Rows HKVD chose are read here: on the CPU a read
        of memory, not a wait for a device."""
        if self.e.triton or (self.causal and host is not None and len(host) == self.n):
            return None
        qpos = self.pos.index_select(0, rows)
        mask = torch.zeros(rows.shape[0], self.n, dtype=self.e.dtype).masked_fill_(
            self.pos[None, :] > qpos[:, None], float("-inf"))
        if not self.runs:
            return mask
        return RowBlocks.of([r + 1 for r in (host if host is not None else rows.tolist())], mask,
                            self.e.cfg.num_heads, self.hd)

    def host_rows(self, p: _Rows) -> tuple[int, ...]:
        """The rows on the host: a read of the device where only it knows them (HKVD chose
        them); only Alg. 1 once it decides and a fallback ask for them then."""
        return p.host if p.host is not None else tuple(p.rows.tolist())

    def kept(self, p: _Rows, h: Tensor, keep: list[int]) -> tuple[_Rows, Tensor]:
        """Rows `keep` (indices into p's rows) alone, with their hidden states."""
        if len(keep) == p.rows.shape[0]:
            return p, h
        host = self.host_rows(p)
        return self.rows_of([host[i] for i in keep]), h.index_select(0, torch.tensor(keep, dtype=torch.long))

    # ---- the loop ---------------------------------------------------------------

    def run(self, all_logits: bool, depth: int | None = None, carry: "Layer0 | None" = None) -> BlendResult:
        """depth: stop after that many layers (no logits then). carry: rows whose layer 0 an
        earlier pass over the same stored KV computed: they join at layer 1. With the engine's
        static steps (`graphs`) leased, the layers that can run as one (`static_step`) do, and
        the result gets its own copy of their caches."""
        if self.e.steps is None:
            return self._run(all_logits, depth, carry)
        with self.e.steps.lease() as self.leased:
            res = self._run(all_logits, depth, carry)
            self._own_static_kv()
        return res

    def _run(self, all_logits: bool, depth: int | None, carry: "Layer0 | None") -> BlendResult:
        e, lay = self.e, self.lay
        for sel in self.selections:
            sel.prepare(self)
        depth = self.L if depth is None else depth
        # A layer's K before its rotation, one buffer for every layer. The merged K and V of a
        # layer are the outputs of its rotation and concatenation: one block of every layer's
        # cache, made here, would be mapped afresh by the OS for each prefill (page faults
        # on every first write), where a layer's size is reused from the process heap.
        self._Kraw = torch.empty(self.hkv, self.n, self.hd, dtype=e.dtype)
        host = self.initial_rows()  # sorted
        if carry is not None:
            carried = carry.rows.tolist()  # on the host already: the question's rows
            host = [r for r in host if r not in set(carried)]
            self._carry = (carried, carry)
        p = self.rows_of(host)
        h = e.embed(lay.tokens.index_select(0, p.rows))  # [R, d]
        for layer in range(depth):
            t0 = time.perf_counter()
            got = self.wait(layer)
            t1 = time.perf_counter()
            p, h = self.fall_back(layer, got, p, h)
            at0 = carry if layer == 0 else None
            out = self.static_step(layer, p, h, got, at0) or self.step(layer, p, h, self.merging(layer, got, at0))
            to_question = self.record_stats(out.rows, out.k, out.v, out.mass)
            if to_question is not None:  # Alg. 1 deciding: its read of the question's attention
                self.focus.update(layer, to_question.tolist())
            self.res.computed_rows.append(out.rows.rows.shape[0])
            self._recomputed.append(out.rows.recomputed)
            p, h = out.rows, out.h
            for sel in self.selections:
                sel.observe(self, layer, out)
            for sel in self.selections:
                p, h = sel.next(self, layer, p, h)
            if layer == 0 and carry is not None:
                p, h = self.joined(p, h, carry)
            t4 = time.perf_counter()
            static = self._static_layers[-1:] == [layer]
            self.res.timings.append(LayerTiming(wait_s=t1 - t0, compute_s=t4 - t1, rotate_s=self._merge_s,
                                                attend_s=self._attend_s, static=static))
        self.res.recomputed_rows = list(self._recomputed)
        for sel in self.selections:
            sel.finish(self)
        if depth < self.L:
            self.res.reused_segments = list(self.live)
            return self.res
        t5 = time.perf_counter()
        logits = e.logits(h if all_logits else h[-1:])  # the rows are sorted: the last is the last prompt row
        self.res.logits = logits[-1]
        self.res.logits_s = time.perf_counter() - t5
        if all_logits:
            self.res.rows, self.res.row_logits = p.rows, logits
        self.res.fresh = self.fresh_chunks()
        self.res.reused_segments = list(self.live)
        self.res.focused, self.res.focus_layer = self.focus.focused, self.focus.layer
        return self.res

    def step(self, layer: int, p: _Rows, h: Tensor, merge: Merge, select: bool = True) -> Stepped:
        """One layer of rows p, every policy's: Q/K/V of the rows, `merge` their K/V into the
        layer's cache (returns it: K post-RoPE, V), the selections' `select` (`select` False:
        a catch-up, none), attention of the rows that stay over the cache, o-proj + MLP."""
        e, c = self.e, self.e.cfg
        qkv = e.qkv_heads(layer, h)  # [Hq+2Hkv, R, D] pre-RoPE
        q, k, v = qkv.split([c.num_heads, c.num_kv_heads, c.num_kv_heads])  # k, v: what a fresh chunk stores
        t0 = time.perf_counter()
        rotated, K, V = merge(p, qkv, k, v)
        self._merge_s = time.perf_counter() - t0
        q = q if rotated is None else rotated
        acting = [sel for sel in self.selections if sel.acts(self, layer)] if select else []
        for sel in acting:
            p, keep = sel.select(self, layer, p, K, V)
            if keep is not None:
                h, q = h.index_select(0, keep), q.index_select(1, keep)
                if self.fresh:
                    k, v = k.index_select(1, keep), v.index_select(1, keep)
        reads = next((r for sel in self.selections if (r := sel.reads_into(self, layer, p)) is not None),
                     None) if select else None
        t1 = time.perf_counter()
        q = p.rot(q) if rotated is None else q
        o, mass = self.attend(p, q, K, V, select, reads)
        self._attend_s = time.perf_counter() - t1
        return Stepped(p, e.layer_out(layer, h, o), q, k, v, mass)

    def static_step(self, layer: int, p: _Rows, h: Tensor, got: LayerKV, carry: "Layer0 | None") -> Stepped | None:
        """`step` as the engine's static step of the rows' bucket (`graphs.StaticStep`: on CUDA
        one graph replayed), where it computes the same: the static steps leased, no selection
        changing the rows in the layer or one that chooses them by their KV deviation (`keeps`:
        `graphs.SelectStep`, the choice made inside the step), reads (if a selection wants
        them) into the bucket's (`key_reads`). Carried rows (`Layer0`) have their K/V written
        into the bucket's buffers before the step, where `merged` writes them. The keys sit
        where `pos` puts them (`graphs.Caches.keys_at`); the attention mass per segment, where
        rows need it (fresh chunks' statistics, Alg. 1 deciding), comes over the bucket's
        segments (`graphs.Caches.segments_of`) and is cut to the prompt's.
        It merges the stored K/V afresh where an earlier phase left a cache of the layer
        (`caches`): the same cache, bit for bit (`query.reusable_caches`), in two copies and
        the step's one launch. None: the eager step runs it (and every layer after it, where
        the step failed: `graphs.StepFailed`)."""
        if not self.leased:
            return None
        acting = [sel for sel in self.selections if sel.acts(self, layer) or sel.compares(self, layer)]
        keep = acting[0].keeps(self, layer, p) if len(acting) == 1 else None
        if acting and keep is None:
            return None
        R = p.rows.shape[0]
        R_out = R - p.n_cand + keep if acting else R  # the rows that run on after the step's choice
        kept = None  # the rows after the choice, where the host knows them: none kept of the candidates
        if acting and keep == 0 and p.host is not None:
            kept = self.rows_of([r for r in p.host if not self.live_host[r]])
        reads = next((r for sel in self.selections if (r := sel.reads_into(self, layer, kept or p)) is not None),
                     None)
        static = self._bucket(lambda: self.e.steps.step(self.n, R, R_out if acting else None))
        if static is None or (reads is not None and (reads is not static.caches.reads or (acting and kept is None))):
            return None
        cc = self._static_cc = static.caches
        t0 = time.perf_counter()
        if not self._keys_placed:
            cc.keys_at(self.pos)
            self._segments = cc.segments_of(self.lay.bounds, self.n) if self.fresh or self.focus.window else 0
            self._keys_placed = True
        cc.merge(layer, *self.stored_pieces(got), self.n)
        if carry is not None:  # RoPE-free K: the step rotates it with the stored K
            cc.raw.index_copy_(1, carry.rows, carry.k)
            cc.V[layer].index_copy_(1, carry.rows, carry.v)
        loaded = self._static_in
        if acting or loaded is None or not (loaded[0] is static and loaded[1] is p and loaded[2] is h):
            static.load(p.rows, h)
        if acting:
            static.choose(p.cand, keep)
        self._merge_s = time.perf_counter() - t0
        want_mass = bool(self.fresh or self.focus.active)
        try:
            q, qkv, mass = static.run(layer, reads is not None, self._segments if want_mass else 0)
        except StepFailed as e:  # its inputs as they were: the eager step runs the layer, and the rest
            self.e.steps.fail(e)
            self.leased = False
            return None
        self._attend_s = 0.0
        c = self.e.cfg
        if acting:
            R_in, R = R, R_out
            acting[0].measured(self, layer, p, static.dev[:p.n_cand])
            p = kept or self.rows_of(rows=static.rows_out[:R].clone(), cand=static.cand_out[:keep].clone(),
                                     n_cand=keep, others=p.others, recomputed=p.recomputed - p.n_cand + keep)
            # As the eager step's: k/v of the rows out where fresh chunks want them, else of the rows in
            # (the step returns the q/k/v heads of its bucket of rows in, then of its rows out).
            slots_in = static.h.shape[0]
            qkv = qkv[:, slots_in:slots_in + R] if self.fresh else qkv[:, :R_in]
            h = static.h_out[:R]
        else:
            qkv, h = qkv[:, :R], static.h[:R]
        _, k, v = qkv.split([c.num_heads, c.num_kv_heads, c.num_kv_heads])
        if want_mass:
            mass = mass[:R, :len(self.lay.segments)].index_select(0, self._needed(p))
        out = Stepped(p, h, q[:, :R], k, v, mass)
        self._static_in = (static, p, h)
        self.kv.append((cc.K[layer][:, :self.n], cc.V[layer][:, :self.n]))
        self._static_layers.append(layer)
        return out

    def _own_static_kv(self) -> None:
        """The static steps' caches are the bucket's, written again by the next prefill: the
        result's layers become copies, one per K and V for each run of consecutive layers that
        ran static (one in all where every layer did)."""
        if not self._static_layers:
            return
        cc = self._static_cc
        runs: list[list[int]] = []
        for layer in self._static_layers:
            if runs and runs[-1][-1] == layer - 1:
                runs[-1].append(layer)
            else:
                runs.append([layer])
        for run in runs:
            K, V = (x[run[0]:run[-1] + 1, :, :self.n].clone() for x in (cc.K, cc.V))
            self.kv[run[0]:run[-1] + 1] = list(zip(K.unbind(0), V.unbind(0)))

    def merging(self, layer: int, got: LayerKV, carry: "Layer0 | None") -> "Merge":
        """`step`'s merge at `layer` of the loop: `merged` with what arrived, or the rows written
        over an earlier phase's cache of the layer (`caches`) where no selection compares there."""
        cache = self.caches.get(layer)
        compares = any(sel.compares(self, layer) for sel in self.selections)
        if cache is None or carry is not None or compares:
            return lambda p, qkv, k, v: self.merged(layer, got, p, qkv, k, v, carry, compares)
        self.kv.append(cache)
        return lambda p, qkv, k, v: self.written(layer, p, qkv, k, v)

    def merged(self, layer: int, got: LayerKV, p: _Rows, qkv: Tensor, k: Tensor, v: Tensor,
               carry: "Layer0 | None" = None, compares: bool = False) -> tuple[Tensor | None, Tensor, Tensor]:
        """The merged cache of `layer`: the live chunks' stored K/V and zeros in prompt order
        (one concatenation each, `pieces`), the computed rows' (and carried rows') k/v written
        over their rows, K rotated to the prompt's positions (from the one buffer `_Kraw`).
        compares: a selection compares the candidates' stored K/V here, kept aside (`stored`).
        Triton: the stored K rotated, then one launch rotates the rows' q and k and writes
        their K/V; returns the rotated q then (else None: `step` rotates the rows it keeps)."""
        c = self.e.cfg
        K = self._Kraw
        k_pieces, v_pieces = self.stored_pieces(got)
        torch.cat(k_pieces, 1, out=K)
        Vl = torch.cat(v_pieces, 1)
        if p.n_cand and compares:
            at = p.rows.index_select(0, p.cand)
            self.stored = at, K.index_select(1, at), Vl.index_select(1, at)
        if carry is not None:
            K.index_copy_(1, carry.rows, carry.k)
            Vl.index_copy_(1, carry.rows, carry.v)
        if self.e.triton:
            Kl = self.rot(K)
            rotated = rope_write_triton(qkv, c.num_heads, *p.rot.tables, p.rows, Kl, Vl)
        else:
            K.index_copy_(1, p.rows, k)
            Vl.index_copy_(1, p.rows, v)
            Kl, rotated = self.rot(K), None
        self.kv.append((Kl, Vl))
        return rotated, Kl, Vl

    def written(self, layer: int, p: _Rows, qkv: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor | None, Tensor, Tensor]:
        """`merge` of a catch-up (`fall_back`), or over an earlier phase's cache (`merging`): rows
        p's K/V written over the layer's merged cache."""
        K, V = self.kv[layer]
        if self.e.triton:
            return rope_write_triton(qkv, self.e.cfg.num_heads, *p.rot.tables, p.rows, K, V), K, V
        K.index_copy_(1, p.rows, p.rot(k))
        V.index_copy_(1, p.rows, v)
        return None, K, V

    def attend(self, p: _Rows, q: Tensor, K: Tensor, V: Tensor, select: bool,
               reads: KeyReads | None = None) -> tuple[Tensor, Tensor | None]:
        """Attention of rows p over the layer's cache, and the attention mass per segment
        [M, S] of the rows that need it where the policy selects (`select`): fresh chunks'
        rows and, while Alg. 1 decides, the question's (`need_rows`; all are computed rows).
        Triton: one launch returns both (the mass of every row, the needed ones taken), and
        adds the rows' reads of each key into `reads` where given (`Selection.reads_into`)."""
        e = self.e
        if not (select and (self.fresh or self.focus.active)):
            return e.attend(q, p.rows, K, V, self.pos, p.mask, reads=reads), None
        at = self._needed(p)
        need = self.need_rows()
        if e.triton:
            o, mass = selective_attention_triton(q, p.rows, K, V, self.pos, scale=e.scale, segments=self.lay.bounds,
                                                 reads=reads, validate=False)
            return o, mass.index_select(0, at)
        return (e.attend(q, p.rows, K, V, self.pos, p.mask),
                attention_mass(q.index_select(1, at), need, K, self.pos, self.lay.bounds, scale=e.scale))

    def key_reads(self) -> KeyReads:
        """Where a phase's attention adds up what its rows read of each key: with the static
        steps leased, their bucket's (`graphs.Caches.reads`, over the bucket's tokens: the first
        n are the prompt's), cleared; else one over the prompt's keys."""
        cc = self._bucket(lambda: self.e.steps.caches(self.n)) if self.leased else None
        if cc is not None:
            cc.reads.clear()
            return cc.reads
        return KeyReads(self.n, self.e.device)

    def _bucket(self, make: "Callable[[], Any]") -> Any:
        """`make()`, a bucket of the static steps, or None where the device has no memory for
        its buffers (`graphs.StepGraphs.out_of_memory`): this prefill runs eagerly from here."""
        try:
            return make()
        except torch.OutOfMemoryError as e:
            self.e.steps.out_of_memory(self.n, e)
            self.leased = False
            return None

    def _needed(self, p: _Rows) -> Tensor:
        """Indices into p's rows of the rows whose attention mass is wanted (`need_rows`)."""
        need = self.need_rows()
        return p.memo("need_focus" if self.focus.active else "need_fresh", lambda: torch.searchsorted(p.rows, need))

    def need_rows(self) -> Tensor:
        return self._need_focus if self.focus.active else self._need_fresh

    def wait(self, layer: int) -> LayerKV:
        if not self.live:
            return {}
        got = self.source.wait_layer(layer, time.monotonic() + self.policy.layer_budget_s)
        want = {s: len(self.lay.segments[s].tokens) for s in self.live}
        return {s: kv for s, kv in got.items() if s in want and self._valid(kv, want[s])}

    def _valid(self, kv: tuple[Tensor, Tensor], t: int) -> bool:
        return len(kv) == 2 and all(x.shape == (self.hkv, t, self.hd) and x.dtype == self.e.dtype for x in kv)

    def fall_back(self, layer: int, got: LayerKV, p: _Rows, h: Tensor) -> tuple[_Rows, Tensor]:
        """Chunks absent at `layer` are computed from now on; catch their rows up through 0..layer-1."""
        absent = [s for s in self.live if s not in got]
        if not absent:
            return p, h
        self.live = [s for s in self.live if s in got]
        self.res.fallbacks += [(s, layer) for s in absent]
        fallen = [r for s in absent for r in range(self.lay.edges[s], self.lay.edges[s + 1])]
        for r in fallen:
            self.live_host[r] = False
        self.live_mask.index_fill_(0, torch.tensor(fallen), False)
        self._live_changed()
        host = self.host_rows(p)
        have = set(host)
        new = [r for r in fallen if r not in have]  # rows already computed have their hidden states
        log.warning("blend: layer %d of chunk(s) %s absent (late/missing/corrupt); computing them "
                    "from here on%s", layer, absent,
                    f", catching up {len(new)} rows through layers 0..{layer - 1}" if layer and new else "")
        if not new:
            return self.rows_of(host), h
        pn = self.rows_of(new)
        hn = self.e.embed(self.lay.tokens.index_select(0, pn.rows))
        for l2 in range(layer):
            hn = self.step(l2, pn, hn, lambda p_, qkv_, k_, v_, l=l2: self.written(l, p_, qkv_, k_, v_),
                           select=False).h
        rows = sorted(host + tuple(new))
        at = {r: i for i, r in enumerate(host + tuple(new))}
        order = torch.tensor([at[r] for r in rows], dtype=torch.long)
        return self.rows_of(rows), torch.cat([h, hn]).index_select(0, order)

    def joined(self, p: _Rows, h: Tensor, carry: Layer0) -> tuple[_Rows, Tensor]:
        """Rows p and the carried rows, which join after layer 0 with their hidden states."""
        both = self.host_rows(p) + tuple(self._carry[0])
        rows = sorted(both)
        at = {r: i for i, r in enumerate(both)}
        order = torch.tensor([at[r] for r in rows], dtype=torch.long)
        return self.rows_of(rows), torch.cat([h, carry.h]).index_select(0, order)

    # ---- statistics (Cache-Craft §3.1, `kvcraft.records.VariantStats`) -----------------

    def _stats_init(self) -> None:
        self._merge_s = self._attend_s = 0.0
        self._recomputed: list[int] = []  # per layer, rows of reused chunks computed
        fresh_rows = [r for s in self.fresh for r in range(self.lay.edges[s], self.lay.edges[s + 1])]
        need = sorted(set(fresh_rows) | set(self.asker_host))
        self._need_fresh = torch.tensor(fresh_rows, dtype=torch.long)  # sorted: fresh chunks in prompt order
        self._need_focus = torch.tensor(need, dtype=torch.long)
        where = {r: i for i, r in enumerate(need)}  # while Alg. 1 decides, mass has the rows `need`
        self._fresh_in_need = torch.tensor([where[r] for r in fresh_rows], dtype=torch.long)
        self._asker_in_need = torch.tensor([where[r] for r in self.asker_host], dtype=torch.long)
        self._fresh_span: dict[int, tuple[int, int]] = {}  # s -> its rows among the fresh rows
        at = 0
        for s in self.fresh:
            t = len(self.lay.segments[s].tokens)
            self._fresh_span[s] = (at, at + t)
            at += t
        self.fresh_kv: list[tuple[Tensor, Tensor]] = []  # per layer, k and v of every fresh row
        self._inter: Tensor | None = None  # [fresh rows, S] sum over layers of their mass per segment
        self._intra: dict[int, list[Tensor]] = {s: [] for s in self.fresh}  # per layer, mass to own chunk (0-d)

    def record_stats(self, p: _Rows, k: Tensor, v: Tensor, mass: Tensor | None) -> Tensor | None:
        """Accumulate fresh chunks' KV and stats; return this layer's inter(C_i, U) per chunk
        while Alg. 1 is deciding (None otherwise)."""
        if mass is None:
            return None
        if self.fresh:  # every row of a fresh chunk is computed at every layer
            at = p.memo("fresh", lambda: torch.searchsorted(p.rows, self._need_fresh))
            self.fresh_kv.append((k.index_select(1, at), v.index_select(1, at)))
            m = mass.index_select(0, self._fresh_in_need) if self.focus.active else mass  # [fresh rows, S]
            self._inter = m if self._inter is None else self._inter + m  # eq. 3 per token and segment
            for s, (a, b) in self._fresh_span.items():
                self._intra[s].append(m[a:b, s].sum())  # eq. 4
        if not self.focus.active:
            return None
        return mass.index_select(0, self._asker_in_need).index_select(1, self.chunks).sum(0)  # [chunks]

    def fresh_chunks(self) -> dict[int, FreshChunk]:
        out = {}
        # eq. 4's sums, one read for every layer and chunk, added up in that order as floats
        flat = torch.stack([x for s in self.fresh for x in self._intra[s]]).tolist() if self.fresh else []
        intra, at = {}, 0
        for s in self.fresh:
            intra[s], at = flat[at:at + len(self._intra[s])], at + len(self._intra[s])
        for s in self.fresh:
            t = len(self.lay.segments[s].tokens)
            a, b = self._fresh_span[s]
            inter = self._inter[a:b, :s].contiguous()  # [t, s]
            per_chunk = inter.sum(0) / (self.L * t)  # eq. 9-10, one per prefix chunk
            b_sum = 0.0
            for x in intra[s]:
                b_sum += x
            out[s] = FreshChunk(
                prefix=self.lay.keys[:s],
                kv=[(k[:, a:b].contiguous(), v[:, a:b].contiguous()) for k, v in self.fresh_kv],
                stats=VariantStats(
                    a=float(per_chunk.sum()),
                    b=b_sum / (self.L * t),
                    prefix_attention=tuple(per_chunk.tolist()),
                    token_inter_attention=tuple(inter.sum(1).tolist()),  # eq. 14 input; one read, not one a token
                ),
            )
        return out
