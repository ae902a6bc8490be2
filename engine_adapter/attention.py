"""The one attention of every pass: query rows by position over a cache by position.

Key j is visible to row r iff ``k_pos[j] <= q_pos[r]`` (Cache-Craft §3.4.3: the computed
rows are a subset of the prompt, so the causal mask of a full prefill becomes a mask by
position). `attend` is the only place a layer's attention is computed; what differs between
passes is how the visibility is given and what a policy asks back:

- ``CAUSAL``: the rows are every key, in order (full prefill): fused SDPA, causal.
- ``EVERY_KEY``: every row sees every key (a decode step over the cache so far).
- a `Visibility` (CPU): the position mask built once per set of rows, whole or as `RowBlocks`
  (runs of rows, each over the keys up to its last row); on the engine's Triton path (CUDA)
  the kernel masks by the positions itself and returns what is asked in the same launch.

Asked back: the attention mass per segment of some rows (`mass_rows`, `segments`: Cache-Craft
eq. 3-4 for a fresh chunk's statistics, eq. 15 for Alg. 1) and what rows read of each key,
summed over rows and heads (`reads`, a `kvkernels.KeyReads`: the default policy's question
pass). On the CPU the reads come from the same probabilities the output is made of (one
softmax; fused SDPA returns none); on the Triton path from inside the kernel's launch.

A pass may also change how some rows read the keys of chunks encoded apart (`Rescale`, APE's
query attention: `policies.ape`): those rows' output is computed again, in plain torch, and
written over the attention's.

The Triton kernel is `kvkernels.selective_attention_triton`, its plain-torch reference
`kvkernels.selective_attention_reference` (tests compare them). Inside an inference engine on a
CPU, the engine's own attention kernel computes the output where nothing else is asked
(`LayerModel.attention`: vLLM's, `engine_adapter.vllm.attention`); what each row sees is
decided here either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from engine_adapter.selection import Rescale
from kvkernels import KeyReads, attention_mass, selective_attention_triton

CAUSAL = "causal"
EVERY_KEY = "every key"
ATTENTION_RUNS = 2  # runs of rows per CPU attention call (`RowBlocks`)
# Rows that are the prompt's last ones, at least this share of it (a prefix reused, the rest
# computed: the prefix cache's pass), are read as causal attention of every row, the rows
# before theirs zeros (`Visibility.after`): the causal kernel skips what no row sees and reads
# no mask, so it beats the masked runs where those rows are few (SmolLM2's shape at 2,200
# tokens, a layer: 49 ms against 71 with 80 rows before, even at 700, behind at 1,100).
SUFFIX_SHARE = 0.75


@dataclass(frozen=True)
class RowBlocks:
    """A set of rows in position order as the CPU attention reads it: ATTENTION_RUNS runs of
    consecutive rows, each over the keys up to its last row only (keys in position order).
    One masked SDPA call over every key computes the hidden keys too (the CPU kernel skips
    blocks only when causal): rows spread over the prompt see about half the keys, so one
    call does nearly twice the work. The number of runs is fixed, whatever the rows, so a
    layer dispatches the same operations; made once per set of rows, not per layer."""

    sizes: tuple[int, ...]  # rows per run, in order (they sum to R; a run may be empty)
    ends: tuple[int, ...]  # keys each run but the last reads (the last reads every key)
    masks: tuple[Tensor, ...]  # per run, the additive mask over the keys it reads [r, end]
    # [Hq, R, D] the runs' outputs, rows-major in memory as SDPA's own output (the o-proj
    # then reads it without a copy); written by each layer's attention, read before the next
    out: Tensor
    out4: Tensor  # the same as [1, Hq, R, D]

    @classmethod
    def of(cls, ends: Sequence[int], mask: Tensor, heads: int, head_dim: int) -> "RowBlocks":
        """ends[i]: the keys row i reads (no key past them is visible to it), ascending;
        mask [R, T]: the rows' additive position-causal mask. The cuts between runs are those
        that read the fewest keys (rows times keys summed over the runs)."""
        R, T = mask.shape

        def reads(a: int, b: int) -> int:  # rows a..b-1 as one run (the last run reads every key)
            return (b - a) * (ends[b - 1] if b < R else T)

        cuts = [0, R]
        for _ in range(ATTENTION_RUNS - 1):  # one cut at a time, each the best given those before
            best = min(((reads(a, i) + reads(i, b) - reads(a, b), i)
                        for a, b in zip(cuts, cuts[1:]) for i in range(a + 1, b)), default=(0, 0))
            cuts = sorted(cuts + [best[1]])  # no row to cut: an empty run first
        sizes = tuple(b - a for a, b in zip(cuts, cuts[1:]))
        last = [max(1, ends[b - 1]) if b > a else 1 for a, b in zip(cuts, cuts[1:])]
        masks = tuple(mask[a:b, :t].contiguous() for a, b, t in zip(cuts, cuts[1:], last[:-1] + [mask.shape[1]]))
        out = torch.empty(R, heads, head_dim, dtype=mask.dtype).transpose(0, 1)
        return cls(sizes, tuple(last[:-1]), masks, out, out[None])


@dataclass(frozen=True)
class Visibility:
    """The CPU's view of which keys each of a set of rows sees, made once per set of rows:
    the additive mask [R, T] (0 or -inf, in the model's dtype) for the probabilities, and how
    SDPA reads it (`blocks`: in runs; None: the mask whole)."""

    mask: Tensor
    blocks: RowBlocks | None = None
    grouped: Tensor | None = None  # the mask repeated for each query head of a kv head [G*R, T]
    after: int | None = None  # the rows are the keys' last ones, after this many (SUFFIX_SHARE)
    runs: Any = None  # the rows as the engine's attention kernel takes them (`LayerModel.attention`)


@dataclass(frozen=True)
class RescaledRows:
    """What a `Rescale` reads with for one set of rows over one cache, derived once (not per
    layer): which of the rows read that way, their position mask and the chunks' keys."""

    at: Tensor  # [Rq] indices into the rows
    mask: Tensor  # [G*Rq, T] fp32 additive: their position mask, once per query head of a kv head
    chunk: Tensor  # [T] bool: the keys of the chunks encoded apart
    temperature: float
    log_scale: float

    @classmethod
    def of(cls, rescale: Rescale, rows: Tensor, q_pos: Tensor, k_pos: Tensor, groups: int) -> "RescaledRows":
        """rows [R]: the step's prompt rows (sorted) at q_pos; k_pos [T]: the keys' positions."""
        at = torch.arange(rows.shape[0], device=rows.device) if rescale.rows is None else \
            torch.searchsorted(rows, rescale.rows.to(rows.device))
        n = min(k_pos.shape[0], rescale.keys.shape[0])
        chunk = torch.cat([rescale.keys[:n].to(k_pos.device), k_pos.new_zeros(k_pos.shape[0] - n, dtype=torch.bool)])
        mask = position_mask(q_pos.index_select(0, at), k_pos, torch.float32).repeat(groups, 1)
        return cls(at, mask, chunk, rescale.temperature, math.log(rescale.scale))


def rescaled_attention(q: Tensor, K: Tensor, V: Tensor, r: RescaledRows, scale: float) -> Tensor:
    """o [Hq, Rq, D] of the rows `r.at` of q [Hq, R, D] over K, V [Hkv, T, D] as APE reads
    (`Rescale`), in fp32. One softmax: APE's two-level softmax is the softmax of the logits s
    with, at the chunks' keys, s/T + (T - 1) lse_chunks(s/T) + log S (each group then carries
    exp(its lse) of the total, as APE combines them); a row that sees no chunk key reads as
    usual (its lse, -inf, is clamped: the chunks' logits stay -inf)."""
    Hq, D = q.shape[0], q.shape[2]
    Hkv = K.shape[0]
    s = torch.baddbmm(r.mask, q.index_select(1, r.at).float().reshape(Hkv, -1, D), K.float().transpose(1, 2),
                      alpha=scale)  # [Hkv, G*Rq, T]
    sharp = (s / r.temperature).masked_fill_(~r.chunk, float("-inf"))
    shift = sharp.logsumexp(-1, keepdim=True).clamp_(min=-1e30).mul_(r.temperature - 1).add_(r.log_scale)
    probs = torch.where(r.chunk, sharp.add_(shift), s).softmax(-1)
    return torch.bmm(probs, V.float()).view(Hq, -1, D).to(q.dtype)


def position_mask(q_pos: Tensor, k_pos: Tensor, dtype: torch.dtype) -> Tensor:
    """[R, T] additive: 0 where k_pos[j] <= q_pos[r], else -inf."""
    return torch.zeros(q_pos.shape[0], k_pos.shape[0], dtype=dtype).masked_fill_(
        k_pos[None, :] > q_pos[:, None], float("-inf"))


def attend(q: Tensor, q_pos: Tensor, K: Tensor, V: Tensor, k_pos: Tensor, visible: "str | Visibility | None", *,
           scale: float, triton: bool, segments: Tensor | None = None, mass_rows: Tensor | None = None,
           reads: "KeyReads | None" = None, reads_rows: Tensor | None = None,
           engine: Any = None, rescale: "RescaledRows | None" = None) -> tuple[Tensor, Tensor | None]:
    """Attention of rotated q [Hq, R, D] (rows at q_pos [R]) over the cache K (rotated), V
    [Hkv, T, D] (keys at k_pos [T]) -> (o [Hq, R, D], mass).

    visible: CAUSAL, EVERY_KEY, the rows' `Visibility` (CPU), or None (Triton: by position).
    segments [S+1] with mass_rows (indices into the rows; None: every row): mass [M, S], the
    attention each of those rows puts on each segment, averaged over heads (fp32).
    reads (`add(x)` of x [..., T]: a `kvkernels.KeyReads`): add what the rows read of each key,
    summed over heads and rows, each row weighted by `reads_rows` [..., R] (None: every row 1).
    On the CPU, leading batch dims pass through (a batch of prompts: `observe`, `learned`).
    engine: the inference engine's attention kernel (`LayerModel.attention`): it computes the
    output where nothing else is asked and the rows see the keys by position (`Visibility.runs`).
    rescale: the output of its rows (`RescaledRows.at`) computed again as APE reads
    (`rescaled_attention`)."""
    if rescale is not None:
        o, mass = attend(q, q_pos, K, V, k_pos, visible, scale=scale, triton=triton, segments=segments,
                         mass_rows=mass_rows, reads=reads, reads_rows=reads_rows, engine=engine)
        return o.index_copy_(1, rescale.at, rescaled_attention(q, K, V, rescale, scale)), mass
    if engine is not None and reads is None and segments is None and q.dim() == 3:
        runs = engine.causal(q.shape[1]) if visible == CAUSAL else getattr(visible, "runs", None)
        if runs is not None:
            return engine(q, K, V, runs, scale), None
    if visible == CAUSAL or visible == EVERY_KEY:
        o = _plain(q, K, V, None, is_causal=visible == CAUSAL, scale=scale)
        mass = None if segments is None else _mass(q, q_pos, K, k_pos, segments, mass_rows, scale)
        if reads is not None:
            _add_reads(reads, q, K, position_mask(q_pos, k_pos, q.dtype), scale, reads_rows)
        return o, mass
    if triton:
        inside = reads if reads_rows is None else None
        o, mass = selective_attention_triton(q, q_pos, K, V, k_pos, scale=scale, segments=segments, reads=inside,
                                             validate=False)
        if reads is not None and inside is None:  # some rows only: their probabilities again, in torch
            _add_reads(reads, q, K, position_mask(q_pos, k_pos, q.dtype), scale, reads_rows)
        return o, (mass if mass is None or mass_rows is None else mass.index_select(0, mass_rows))
    assert isinstance(visible, Visibility), "the CPU attention needs the rows' Visibility"
    if reads is not None and reads_rows is None and q.dim() == 3:
        o, probs = _explicit(q, K, V, visible, scale)
        reads.add(probs.sum((0, 1)))
    else:
        o = _sdpa(q, K, V, visible, scale)
        if reads is not None:
            _add_reads(reads, q, K, visible.mask, scale, reads_rows)
    mass = None if segments is None else _mass(q, q_pos, K, k_pos, segments, mass_rows, scale)
    return o, mass


def _plain(q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None, *, is_causal: bool = False,
           scale: float) -> Tensor:
    """Fused SDPA on 4-D inputs (3-D ones send CPU SDPA down its unfused math path, ~6x
    slower); a mask [..., R, T] with batch dims is broadcast over the heads."""
    gqa = q.shape[-3] != K.shape[-3]
    if q.dim() == 3:
        return F.scaled_dot_product_attention(q[None], K[None], V[None], attn_mask=mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=gqa)[0]
    if mask is not None and mask.dim() > 2:
        mask = mask.unsqueeze(-3)
    return F.scaled_dot_product_attention(q, K, V, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)


def _sdpa(q: Tensor, K: Tensor, V: Tensor, visible: Visibility, scale: float) -> Tensor:
    """Fused SDPA with the rows' mask: whole, or in runs of rows each over its keys."""
    gqa = q.shape[0] != K.shape[0]
    if visible.after is not None:
        padded = torch.cat([q.new_zeros(q.shape[0], visible.after, q.shape[2]), q], 1)
        return _plain(padded, K, V, None, is_causal=True, scale=scale)[:, visible.after:]
    blocks = visible.blocks
    if blocks is None:
        return _plain(q, K, V, visible.mask, scale=scale)
    k, v = K[None], V[None]  # [1, Hkv, T, D]
    runs = q[None].split(blocks.sizes, 2)  # [1, Hq, r, D] each
    o = [F.scaled_dot_product_attention(run, k.narrow(2, 0, end), v.narrow(2, 0, end), attn_mask=m, scale=scale,
                                        enable_gqa=gqa)
         for run, end, m in zip(runs, blocks.ends, blocks.masks)]
    o.append(F.scaled_dot_product_attention(runs[-1], k, v, attn_mask=blocks.masks[-1], scale=scale,
                                            enable_gqa=gqa))  # the last run reads every key
    torch.cat(o, 2, out=blocks.out4)
    return blocks.out


def _explicit(q: Tensor, K: Tensor, V: Tensor, visible: Visibility, scale: float) -> tuple[Tensor, Tensor]:
    """The output and the probabilities [Hkv, G*R, T] from one softmax (fp32): the query
    heads of a kv head read it together, one batched matmul each way, no repeated K."""
    Hq, R, D = q.shape
    Hkv = K.shape[0]
    grouped = visible.grouped if visible.grouped is not None else visible.mask.repeat(Hq // Hkv, 1)
    probs = torch.baddbmm(grouped.float(), q.float().reshape(Hkv, -1, D), K.float().transpose(1, 2),
                          alpha=scale).softmax(-1)  # [Hkv, G*R, T]
    return torch.bmm(probs, V.float()).view(Hq, R, D).to(q.dtype), probs


def add_reads(reads: "KeyReads", q: Tensor, q_pos: Tensor, K: Tensor, k_pos: Tensor, scale: float,
              weights: Tensor | None) -> None:
    """What rows q [Hq, R, D] at q_pos read of each key of K at k_pos, each row weighted
    (`weights` [R]), beside an attention that returned none (a static step's whose rows are
    not all the question's)."""
    _add_reads(reads, q, K, position_mask(q_pos, k_pos, q.dtype), scale, weights)


def _add_reads(reads: "KeyReads", q: Tensor, K: Tensor, mask: Tensor, scale: float, weights: Tensor | None) -> None:
    """What rows q read of each key, each weighted (`weights` [..., R]), beside an attention
    that returns none: their probabilities again (fp32), summed over heads and rows."""
    *batch, Hq, R, D = q.shape
    Hkv = K.shape[-3]
    G = Hq // Hkv
    grouped = mask.unsqueeze(-3) if mask.dim() > 2 else mask  # [..., 1 | R, T]
    scores = q.float().reshape(*batch, Hkv, G, R, D) @ K.float().unsqueeze(-3).transpose(-1, -2)  # [..., Hkv, G, R, T]
    probs = (scores * scale + grouped.unsqueeze(-3).float()).softmax(-1)
    if weights is not None:
        probs = probs * weights.float()[..., None, None, :, None]
    reads.add(probs.sum((-4, -3, -2)))


def _mass(q: Tensor, q_pos: Tensor, K: Tensor, k_pos: Tensor, segments: Tensor, rows: Tensor | None,
          scale: float) -> Tensor:
    """Attention mass per segment [M, S] of rows `rows` (None: all), beside an attention that
    returns none (`kvkernels.attention_mass`: probabilities only for those rows)."""
    if rows is not None:
        q, q_pos = q.index_select(1, rows), q_pos.index_select(0, rows)
    return attention_mass(q, q_pos, K, k_pos, segments, scale=scale)


__all__ = ["ATTENTION_RUNS", "CAUSAL", "EVERY_KEY", "SUFFIX_SHARE", "RescaledRows", "RowBlocks", "Visibility",
           "add_reads", "attend", "position_mask", "rescaled_attention"]
