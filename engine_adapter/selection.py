"""Which tokens of a reused chunk to recompute: per-variant scores and a prompt budget.

Pure functions on torch tensors (CPU reference; the CUDA path uses the same math).

A *learned* recompute list (issue 19). A chunk's KV depends on what came before it only
through some of its tokens (a pronoun's referent, the token the model keeps a binding
on). When the same chunk has been computed in full behind two different prefixes, the
tokens whose KV moved between the two computations are exactly those: CacheBlend's KV
deviation (§4.1-4.2), measured once, offline, over every layer, instead of online on
layer 1 of each request (§4.3, HKVD). The scores are stored with the variant, so the
next reuse of it, behind any prefix, knows which tokens to recompute without computing
a layer of the chunk first.

`kv_deviation` scores the tokens; `allocate` spends one prompt-wide budget on the
highest-scoring tokens of all reused chunks, so a chunk that does not depend on its
prefix (a chain head, a distractor) gets nothing and one that does gets several
(Cache-Craft §3.2 gives a per-chunk budget from CCI/CFO, eq. 12-13; here the measured
deviation itself ranks tokens across chunks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import Tensor

# Share of the reused chunk tokens a learned list recomputes by default (prompt-wide,
# `allocate`): chosen on a validation draw of the quality task (docs/quality.md).
DEFAULT_BUDGET = 0.15

KV = Sequence[tuple[Tensor, Tensor]]  # per layer (K RoPE-free [Hkv, T, D], V [Hkv, T, D])


def kv_deviation(stored: KV, observed: KV, layers: Sequence[int] | None = None) -> Tensor:
    """Per token of one chunk [T]: how far its KV moved between two full computations.

    stored, observed: the chunk's per-layer KV computed behind two different prefixes
    (or one behind a prefix and one alone). Per layer l (CacheBlend §4.1 KV deviation,
    L2 instead of L1) the deviation of token t is ||dK_t|| + ||dV_t|| divided by the
    layer's mean ||K|| + ||V||, so layers of different scale count alike; the score is
    the sum over `layers` (default: every layer but the first, whose K/V are
    projections of the token embeddings and never move, docs/adapter.md).
    """
    if len(stored) != len(observed):
        raise ValueError(f"{len(stored)} stored layers vs {len(observed)} observed")
    use = range(1, len(stored)) if layers is None else layers
    score = None
    for l in use:
        (ks, vs), (ko, vo) = stored[l], observed[l]
        if ks.shape != ko.shape or vs.shape != vo.shape:
            raise ValueError(f"layer {l}: stored {tuple(ks.shape)} vs observed {tuple(ko.shape)}")
        dev = (ko.float() - ks.float()).norm(dim=2).sum(0) + (vo.float() - vs.float()).norm(dim=2).sum(0)  # [T]
        scale = (ks.float().norm(dim=2).sum(0) + vs.float().norm(dim=2).sum(0)).mean().clamp_min(1e-12)
        score = dev / scale if score is None else score + dev / scale
    if score is None:
        raise ValueError("no layer to compare")
    return score


@dataclass(frozen=True)
class Observation:
    """A chunk computed in full inside one request, as the engine sees it then."""

    kv: list[tuple[Tensor, Tensor]]  # per layer (K RoPE-free [Hkv, T, D], V [Hkv, T, D]) of the chunk
    received: Tensor  # [T] attention the request's question put on each chunk token


@torch.no_grad()
def observe(engine, tokens: Sequence[int], span: tuple[int, int], readers: tuple[int, int],
            layers: Sequence[int] | None = None) -> Observation:
    """Full causal prefill of `tokens`; the KV of rows `span` (a chunk) and how much rows
    `readers` (the question) attend to each of them: attention probabilities averaged over
    heads, summed over reader rows and `layers` (default: every layer but the first).

    Cache-Craft eq. 15 measures the question's attention per chunk (inter(C_i, U)) to
    find the focused chunks; `received` is the same quantity per token. Plain torch with
    the engine's own primitives; spans are [start, end) rows.
    """
    from kvkernels import apply_rope

    toks = torch.as_tensor(list(tokens), dtype=torch.long)
    t = len(toks)
    pos = torch.arange(t)
    c = engine.cfg
    g = c.num_heads // c.num_kv_heads
    use = set(range(1, c.num_layers) if layers is None else (l % c.num_layers for l in layers))
    causal = torch.ones(t, t, dtype=torch.bool).triu(1)
    got = torch.zeros(span[1] - span[0])
    kv = []
    h = engine.embed(toks)  # [T, d]
    for layer in range(c.num_layers):
        q, k, v = engine.qkv(layer, h)  # [H, T, D] pre-RoPE
        kv.append((k[:, span[0]:span[1]].clone(), v[:, span[0]:span[1]].clone()))
        q, k = apply_rope(q, pos, engine.rope), apply_rope(k, pos, engine.rope)
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)  # [Hq, T, D]
        p = ((q @ k.transpose(1, 2)) * engine.scale).masked_fill(causal, float("-inf")).softmax(-1)  # [Hq, T, T]
        if layer in use:
            got += p[:, readers[0]:readers[1], span[0]:span[1]].float().mean(0).sum(0)
        h = engine.mlp(layer, engine.attn_out(layer, h, p @ v))
    return Observation(kv, got)


def learned_scores(stored: KV, seen: Observation) -> Tensor:
    """The learned recompute scores of a chunk's stored variant [T]: what the question of a
    request that computed the chunk in full read from each token, times how far the
    token's KV moved from the stored variant's (CacheBlend §4.1 deviation).

    Deviation alone ranks every prefix-dependent token (a city that attends back, a
    pronoun) and reading alone ranks tokens that hold the chunk's own facts; the product
    keeps the tokens that both changed and are read, which is what a stale cache gets
    wrong (docs/quality.md, token selection).
    """
    return kv_deviation(stored, seen.kv) * seen.received


def merge_scores(old: Sequence[float], new: Sequence[float]) -> tuple[float, ...]:
    """Scores of a variant observed again: the elementwise maximum (a token that moved
    behind any prefix seen so far stays on the list)."""
    if old and len(old) != len(new):
        raise ValueError(f"{len(old)} old scores vs {len(new)} new")
    return tuple(max(a, b) for a, b in zip(old, new)) if old else tuple(float(x) for x in new)


def order(scores: Sequence[float]) -> tuple[int, ...]:
    """Token indices by descending score, ties by index (the variant's recompute order)."""
    return tuple(sorted(range(len(scores)), key=lambda i: (-scores[i], i)))


def allocate(scores: Mapping[int, Sequence[float]], budget: float) -> dict[int, tuple[int, ...]]:
    """Spend a prompt-wide budget on the highest-scoring tokens of all reused chunks.

    scores: chunk (segment index) -> per-token score; budget: share of all their tokens
    to recompute, in [0, 1], an upper bound: floor(budget * total) tokens are chosen.
    Returns chunk -> sorted token indices (every chunk present, possibly empty); ties by
    chunk, then index.
    """
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"budget {budget} outside [0, 1]")
    total = sum(len(s) for s in scores.values())
    n = math.floor(budget * total + 1e-9)
    ranked = sorted(((-float(x), c, i) for c, s in scores.items() for i, x in enumerate(s)))
    out: dict[int, list[int]] = {c: [] for c in scores}
    for _, c, i in ranked[:n]:
        out[c].append(i)
    return {c: tuple(sorted(v)) for c, v in out.items()}


def per_chunk(scores: Mapping[int, Sequence[float]], fraction: float) -> dict[int, tuple[int, ...]]:
    """The top ceil(fraction |C|) tokens of every chunk (Cache-Craft §3.2.1's N per chunk)."""
    out = {}
    for c, s in scores.items():
        n = math.ceil(fraction * len(s) - 1e-9)
        out[c] = tuple(sorted(order(s)[:n]))
    return out


__all__ = ["DEFAULT_BUDGET", "Observation", "observe", "learned_scores", "kv_deviation", "merge_scores", "order", "allocate", "per_chunk"]
