"""One layer step, the only place a layer is computed: every pass runs it (full prefill, each
policy's passes, decode, `observe`, the learned lists' measurements) and the static steps
capture it as a CUDA graph (`engine_adapter.graphs`) rather than copying it.

gpt-fast's `TransformerBlock` in kvcraft's terms: the rows a pass computes are its
`input_pos` over a subset of the prompt, and the merged cache is a KV cache written at those
rows. Per layer, for rows R (positions p) with hidden states h [R, d]:

    x = RMSNorm(h); q, k, v = x Wqkv                         (the model's own linear parts)
    K = rotate(stored K) where the cache holds it RoPE-free  (Cache-Craft §3.4.1: K is stored
                                                              without RoPE, rotated to its new place)
    q, k rotated to p; k, v written into the cache at R      (one Triton launch on CUDA, the stored
                                                              K's rotation in it where no choice reads it)
    [a choice of rows: keep the candidates whose written K/V deviate most from the stored
     ones, CacheBlend §4.3; the rest of the layer runs for those]
    o = attention of the rows over the cache, by position    (`engine_adapter.attention`)
    h = h + MLP(...) after o-proj                            (the model's own linear parts)

The model supplies the linear parts (`qkv_heads`, `layer_out`: norms, projections, MLP); the
step owns the rows, the rotation, the cache and the attention. Nothing in it reads a device
value on the host or allocates by a value only the device knows, so the same code runs
eagerly (the CPU, the reference) and is captured per bucket of shapes on CUDA.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from engine_adapter.attention import CAUSAL, RescaledRows, Visibility, attend
from engine_adapter.selection import Rescale
from kvkernels import KeyReads, kv_deviation, rotate_triton
from kvkernels.layer import rope_write_triton


class Rotation:
    """RoPE tables of some positions, laid out to rotate rows at those positions in one op.

    `triton`: `kvkernels.rotate_triton` (one launch) with the [T, D/2] cos and sin tables. Else
    the arithmetic of `kvkernels.rotate_reference` (x1 cos - x2 sin, x2 cos + x1 sin in fp32,
    rounded once), bit for bit, in four operations instead of its nine: x [cos, cos] +
    roll(x, D/2) [-sin, sin] (x2 (-sin) is -(x2 sin) exactly, a + -b is a - b)."""

    def __init__(self, cos: Tensor, sin: Tensor, triton: bool):
        self.cos, self.sin = cos, sin  # [T, D/2] fp32
        self.triton = triton
        # the CPU's form: [cos, cos], [-sin, sin] [T, D]
        self.tables = (cos, sin) if triton else (torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1))

    def at(self, idx: Tensor) -> "Rotation":
        """The tables of rows `idx` of these, made at their first use (a static step, which
        derives its rows' tables inside itself, never uses them)."""
        return _RotationAt(self, idx)

    def __call__(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """x [H, T, D] rotated (T = the tables' rows), into `out` if given. (CPU: tables of a batch
        of prompts [..., 1, T, D/2] rotate x [..., H, T, D].)"""
        a, b = self.tables
        if self.triton:
            return rotate_triton(x, a, b, out=out)
        xf = x.float()
        turned = xf.roll(xf.shape[-1] // 2, -1).mul_(b)
        if out is not None and out.dtype == torch.float32:
            return torch.mul(xf, a, out=out).add_(turned)
        r = torch.mul(xf, a).add_(turned).to(x.dtype)
        return r if out is None else out.copy_(r)


class _RotationAt(Rotation):
    def __init__(self, of: Rotation, idx: Tensor):  # noqa: D107 - `Rotation.at`
        self._of, self._idx, self._made = of, idx, None

    def _tables(self) -> Rotation:
        if self._made is None:
            self._made = Rotation(self._of.cos.index_select(0, self._idx), self._of.sin.index_select(0, self._idx),
                                  self._of.triton)
        return self._made

    cos = property(lambda self: self._tables().cos)
    sin = property(lambda self: self._tables().sin)
    tables = property(lambda self: self._tables().tables)
    triton = property(lambda self: self._of.triton)


@dataclass
class Rows:
    """The rows a step computes and what it derives from them (once per set of rows, never
    per layer): their cache rows, their positions to the attention (-1 for a padded row of a
    static step: it sees no key), their RoPE tables, and how the attention sees the keys
    (`attention.CAUSAL`, `EVERY_KEY`, a CPU `Visibility`, or None: by position, Triton)."""

    rows: Tensor  # [R] where their K/V are written (their prompt rows)
    pos: Tensor  # [R] their positions to the attention
    rot: Rotation  # tables at their positions
    visible: "str | Visibility | None"
    memo: dict = field(default_factory=dict)  # what a step derives from them once (`index_of`)

    @property
    def count(self) -> int:
        return self.rows.shape[0]

    def index_of(self, prompt_rows: Tensor) -> Tensor:
        """Indices into these rows of `prompt_rows` (sorted, among them), once per set."""
        key = id(prompt_rows)
        if key not in self.memo:
            self.memo[key] = (prompt_rows, torch.searchsorted(self.rows, prompt_rows))
        return self.memo[key][1]

    def computed(self, n: int) -> Tensor:
        """[n] bool: True at these rows' cache rows of a cache of n keys, once per set."""
        key = ("computed", n)
        if key not in self.memo:
            self.memo[key] = torch.zeros(n, dtype=torch.bool, device=self.rows.device).index_fill_(0, self.rows, True)
        return self.memo[key]


@dataclass
class LayerCache:
    """One layer's cache as the step sees it: K post-RoPE and V [Hkv, N, D] with the keys'
    positions [N]. `raw`: the stored K before its rotation (with `rot`, the keys' tables):
    the step rotates it into K first (into `K` where given: a static step's buffer). K and
    V both None: the rows are every key, in order (full prefill), and become the cache."""

    K: Tensor | None
    V: Tensor | None
    pos: Tensor | None
    raw: Tensor | None = None
    rot: Rotation | None = None


@dataclass
class Choice:
    """CacheBlend §4.3's choice inside a layer: of the rows, every one that is not a candidate
    stays, and the `keep` candidates whose K/V just written deviate most from the cache's
    (the stored K/V: §4.1's deviation, |K - K'| + |V - V'| summed over heads and dims; ties to
    the earlier candidate). The candidates are `cand` [C] (indices into the rows, in order);
    `n_cand` and `keep` may be device values (a static step's, over fixed slots). The step
    returns every candidate's deviation beside what it kept."""

    cand: Tensor
    n_cand: "int | Tensor"
    keep: "int | Tensor"
    rows_out: int  # slots of rows after the choice (exactly R - C + keep where not static)
    # (the indices kept into the rows, which of those slots hold a row, the kept candidates'
    # indices among them) -> the rows the rest of the layer runs (the caller's: eagerly a new
    # set of rows, in a static step its buffers of rows out)
    rows_after: Callable[[Tensor, Tensor, Tensor], "Rows"]


@dataclass
class Stepped:
    """What one layer step made."""

    rows: Rows  # the rows that ran the attention and MLP (after a choice)
    rows_in: Tensor  # [R] the rows whose K/V the layer wrote (before a choice)
    h: Tensor  # [R', d] their hidden states after the layer
    q: Tensor  # [Hq, R', D] their queries, rotated
    qkv: Tensor  # [Hq+2Hkv, R, D] pre-RoPE q/k/v heads of every row whose K/V the layer wrote
    K: Tensor  # the layer's cache after it: K post-RoPE [Hkv, N, D]
    V: Tensor
    kept: Tensor | None = None  # with a choice: [R'] indices into the rows in of those kept
    cand_out: Tensor | None = None  # with a choice: the kept candidates' indices among the rows out
    deviation: Tensor | None = None  # with a choice: [C] each candidate's deviation
    mass: Any = None  # [M, S] attention mass per segment of the rows asked for (the loop: or `stats.Later`)
    rotate_s: float = 0.0  # the stored K's rotation's wall time (eager steps; on a GPU its launch's)
    attend_s: float = 0.0  # the attention's


def layer_step(model: Any, layer: int, h: Tensor, rows: Rows, cache: LayerCache, *, choice: Choice | None = None,
               segments: Tensor | None = None, mass_of: Tensor | None = None, reads: KeyReads | None = None,
               reads_rows: Tensor | None = None, rescale: Rescale | None = None, rest: Rows | None = None) -> Stepped:
    """Layer `layer` for hidden rows h [R, d] at `rows` over `cache` (see the module docstring).
    `model.triton`: the Triton kernels (the fused rotate-and-write, the attention by position).
    rest: some of the rows (after a choice, if any): only they run the attention and the layer's
    output once every row's K/V is written (the last layer, where only the last row's hidden
    state is read: the loop's `last_only`); the step returns theirs.
    What the attention returns besides (`attention.attend`): with `segments`, the attention
    mass per segment of the prompt rows `mass_of` (sorted; rows a choice keeps); with `reads`,
    what the rows that attend read of each key (each weighted by `reads_rows` [R]; None: 1).
    rescale: some rows read the chunks encoded apart as APE does (`selection.Rescale`).
    On the CPU, leading batch dims pass through (h [..., R, d]: a batch of prompts, with rows
    [R] the same in each, or [..., R] each its own; `observe`, `learned`)."""
    qkv = model.qkv_heads(layer, h)  # [Hq+2Hkv, R, D] pre-RoPE
    K, V = cache.K, cache.V
    heads, hkv = model.cfg.num_heads, model.cfg.num_kv_heads
    t0 = time.perf_counter()
    if cache.raw is not None and choice is None and not model.triton:
        # On the CPU, where no choice compares the stored K with the rows', the rows' k joins the
        # stored K before its one rotation (an op fewer than turning the rows' q and k apart)
        q, k, v = qkv.split([heads, hkv, hkv], dim=-3)
        cache.raw.index_copy_(1, rows.rows, k)
        V.index_copy_(1, rows.rows, v)
        K = cache.rot(cache.raw, out=K)
        out = Stepped(rows, rows.rows, h, rows.rot(q), qkv, K, V, rotate_s=time.perf_counter() - t0)
        return _attend_and_out(model, layer, out, cache, segments, mass_of, reads, reads_rows, rescale, rest)
    stored = None
    if cache.raw is not None and model.triton and choice is None:  # rotated in the rows' write's launch
        stored = (cache.raw, cache.rot.cos, cache.rot.sin, rows.computed(cache.raw.shape[1]))
        K = torch.empty_like(cache.raw) if K is None else K
    elif cache.raw is not None:
        K = cache.rot(cache.raw, out=K)
    rotate_s = time.perf_counter() - t0
    old = None
    if choice is not None:  # the candidates' stored K/V, before the rows' are written over them
        at = rows.rows.index_select(0, choice.cand)
        old = at, K.index_select(1, at), V.index_select(1, at)
    fresh = K is None  # the rows are every key: their K/V become the cache
    if model.triton:
        if fresh:
            K = torch.empty(hkv, rows.count, qkv.shape[-1], dtype=qkv.dtype, device=qkv.device)
            V = torch.empty_like(K)
        q = rope_write_triton(qkv, heads, rows.rot.cos, rows.rot.sin, rows.rows, K, V, stored)
    else:  # (with leading batch dims too: a batch of prompts)
        qk, v = qkv.split([heads + hkv, hkv], dim=-3)
        q, k = rows.rot(qk).split([heads, hkv], dim=-3)  # one rotation turns q and k
        if fresh:
            K, V = k, v
        elif rows.rows.dim() == 1:
            K.index_copy_(-2, rows.rows, k)
            V.index_copy_(-2, rows.rows, v)
        else:  # each prompt of the batch its own rows [..., R]
            at = rows.rows[..., None, :, None].expand(k.shape)
            K.scatter_(-2, at, k)
            V.scatter_(-2, at, v)
    out = Stepped(rows, rows.rows, h, q, qkv, K, V, rotate_s=rotate_s)
    if choice is not None:
        out = _choose(out, choice, old, model.ranks)
        if model.ranks is not None:  # (a tensor-parallel engine's ranks: one choice, `ranks`)
            model.ranks.same_rows(f"the rows layer {layer} kept", out.kept)
    return _attend_and_out(model, layer, out, cache, segments, mass_of, reads, reads_rows, rescale, rest)


def _attend_and_out(model: Any, layer: int, out: Stepped, cache: LayerCache, segments: Tensor | None,
                    mass_of: Tensor | None, reads: KeyReads | None, reads_rows: Tensor | None,
                    rescale: Rescale | None, rest: Rows | None) -> Stepped:
    """The rest of `layer_step`, for `out`'s rows (`rest` of them where given) once their K/V
    are in the cache: their attention over it (and what it returns besides), then the model's
    o-proj and MLP."""
    t0 = time.perf_counter()
    k_pos = out.rows.rows if cache.pos is None else cache.pos
    if rest is not None:
        at = out.rows.index_of(rest.rows)
        out.rows, out.h, out.q = rest, out.h.index_select(0, at), out.q.index_select(1, at)
        cache = LayerCache(out.K, out.V, k_pos)  # the keys where the rows put them: `rest` sees them by position
    rows = out.rows
    if rescale is not None:
        key = ("rescale", id(rescale), out.K.shape[-2])
        if key not in rows.memo:  # once per set of rows
            rows.memo[key] = (rescale, RescaledRows.of(rescale, rows.rows, rows.pos, k_pos,
                                                      model.cfg.num_heads // model.cfg.num_kv_heads))
        rescale = rows.memo[key][1]
    o, out.mass = attend(out.q, rows.pos, out.K, out.V, k_pos,
                         CAUSAL if cache.pos is None else rows.visible, scale=model.scale, triton=model.triton,
                         segments=segments, mass_rows=None if mass_of is None else rows.index_of(mass_of),
                         reads=reads, reads_rows=reads_rows, engine=model.attention, rescale=rescale)
    out.attend_s = time.perf_counter() - t0  # (eagerly; a graph's replay runs no Python)
    out.h = _layer_out(model, layer, out.h, o)
    return out


def _layer_out(model: Any, layer: int, h: Tensor, o: Tensor) -> Tensor:
    """`model.layer_out` over blocks of at most `model.max_rows` rows (None: all at once). Its
    MLP's working tensors are the largest of a layer (an 8B Llama's: 28,672 values a row in
    gate and up); an engine's own forward pass is sized for its token budget, and a prompt
    longer than that is computed within it, as the engine's chunked prefill would."""
    n = model.max_rows
    if n is None or h.dim() != 2 or h.shape[0] <= n:
        return model.layer_out(layer, h, o)
    return torch.cat([model.layer_out(layer, h[a:a + n], o[:, a:a + n]) for a in range(0, h.shape[0], n)])


def _choose(out: Stepped, choice: Choice, old: tuple[Tensor, Tensor, Tensor], ranks: Any) -> Stepped:
    """`Choice` over fixed slots, with no host read: the deviation, a stable sort, prefix sums
    and a search (the same where the counts are exact, eagerly). `ranks`: a tensor-parallel
    engine's (`ranks.TensorRanks`): the deviation is summed over every rank's heads."""
    at, k_old, v_old = old
    K, V, rows = out.K, out.V, out.rows
    slots = torch.arange(1, choice.cand.shape[0] + 1, device=at.device)
    valid = slots <= choice.n_cand  # [slots] which candidate slots hold one
    dev = kv_deviation(K.index_select(1, at), V.index_select(1, at), k_old, v_old)
    if ranks is not None:
        dev = ranks.sum(dev)
    dev = dev.masked_fill(~valid, float("-inf"))
    # The `keep` of highest deviation, ties to the lower slot: a candidate stays where fewer
    # than `keep` rank before it.
    order = torch.sort(dev, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(0, order, slots - 1)
    chosen = (rank < choice.keep) & valid
    # The rows that stay: every row less the candidates, and the chosen candidates; in order,
    # out slot j takes the (j+1)-th (prefix sums, a search).
    real = rows.pos >= 0
    stays = real.long().index_add_(0, choice.cand, chosen.long() - valid.long())
    counts = stays.cumsum(0)
    slots_out = torch.arange(1, choice.rows_out + 1, device=at.device)
    kept = torch.searchsorted(counts, slots_out).clamp_(max=rows.count - 1)
    real_out = slots_out <= counts[-1]
    picked = torch.searchsorted(chosen.long().cumsum(0), slots).clamp_(max=choice.cand.shape[0] - 1)
    cand_out = counts.index_select(0, choice.cand.index_select(0, picked)) - 1
    after = choice.rows_after(kept, real_out, cand_out)
    return Stepped(after, out.rows_in, out.h.index_select(0, kept), out.q.index_select(1, kept), out.qkv, K, V,
                   kept=kept, cand_out=cand_out, deviation=dev, rotate_s=out.rotate_s)


__all__ = ["Choice", "LayerCache", "Rotation", "Rows", "Stepped", "layer_step"]
