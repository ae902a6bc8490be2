"""Which tokens of a reused chunk to recompute: learned per-variant scores and a prompt budget.

Pure functions on torch tensors (CPU reference; the CUDA path uses the same math).

A *learned* recompute list (issue 19). A chunk's KV depends on what came before it only
through some of its tokens (a pronoun's referent, the token the model keeps a binding
on). When a request computes a chunk in full although a variant of it is stored (behind
another prefix), both are at hand: `fresh_gain` measures, per token, how much of that
request's answer the stored variant's stale KV of the token costs (the answer's KL
divergence with the chunk stale, minus with only that token fresh). That is the
quantity Cache-Craft §3.2 recomputes tokens to reduce, measured at the output instead
of estimated from attention (eq. 14) or from KV deviation on layer 1 (CacheBlend §4.3,
HKVD). The scores are stored with the variant it created (`VariantStats.recompute_scores`),
merged over the requests that computed the chunk (`merge_scores`), so the next reuse,
behind any prefix, knows which tokens to recompute without computing a layer first.

`allocate` (from `kvcraft.recompute`, shared with the planner) spends one prompt-wide
budget on the highest scores of all reused chunks, so a chunk that does not depend on
its prefix (a chain head, a distractor) gets nothing and one that does gets its binding
token(s).

Also here, measured side by side in `kvbench.quality.selection` and kept as references:
`kv_deviation` (CacheBlend §4.1 offline) and `learned_scores` = deviation x what the
question read (`observe`, Cache-Craft eq. 15 per token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

# The pure-Python part (budget, ranking, merging) lives in the contract package so the
# planner, which never imports torch, spends budgets the same way.
from kvcraft.recompute import DEFAULT_BUDGET, allocate, merge_scores, order, per_chunk

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
    # [L, T] the same per layer (zero rows for layers not counted); `received` is its sum
    received_per_layer: Tensor | None = None
    # with observe_many(context=True): the request as a `GainCase` against a stored variant
    # (per layer K post-RoPE [Hkv, P, D], V of the rows before the question; the question)
    context: list[tuple[Tensor, Tensor]] | None = None
    span: tuple[int, int] | None = None
    question: tuple[int, ...] | None = None


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
    got = torch.zeros(c.num_layers, span[1] - span[0])
    kv = []
    h = engine.embed(toks)  # [T, d]
    for layer in range(c.num_layers):
        q, k, v = engine.qkv(layer, h)  # [H, T, D] pre-RoPE
        kv.append((k[:, span[0]:span[1]].clone(), v[:, span[0]:span[1]].clone()))
        q, k = apply_rope(q, pos, engine.rope), apply_rope(k, pos, engine.rope)
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)  # [Hq, T, D]
        p = ((q @ k.transpose(1, 2)) * engine.scale).masked_fill(causal, float("-inf")).softmax(-1)  # [Hq, T, T]
        if layer in use:
            got[layer] = p[:, readers[0]:readers[1], span[0]:span[1]].float().mean(0).sum(0)
        h = engine.mlp(layer, engine.attn_out(layer, h, p @ v))
    return Observation(kv, got.sum(0), got)


Request = tuple[Sequence[int], tuple[int, int], tuple[int, int]]  # tokens, chunk span, reader rows


@torch.no_grad()
def observe_many(engine, requests: Sequence[Request], layers: Sequence[int] | None = None,
                 batch: int = 256, context: bool = False) -> list[Observation]:
    """`observe` for many (tokens, span, readers) at once: right-padded batches of full
    causal prefills (a real row never sees a pad after it), the row-wise layers (norms,
    projections, MLP) on all rows of a batch together. Empty `readers` give zero reads:
    the chunk's KV alone (a variant computed behind `tokens[:span[0]]`). Same result as
    `observe` per request (tested); what the quality benchmark and its CI test use to
    build thousands of variants in seconds. `context=True` also keeps what `gain_case`
    needs: the rows before the readers (the question, which must be the last rows).
    """
    from kvkernels import rope_tables, rotate

    c = engine.cfg
    g = c.num_heads // c.num_kv_heads
    use = set(range(1, c.num_layers) if layers is None else (l % c.num_layers for l in layers))
    out: list[Observation] = []
    for start in range(0, len(requests), batch):
        part = requests[start:start + batch]
        b, t = len(part), max(len(r[0]) for r in part)
        toks = torch.zeros(b, t, dtype=torch.long)
        readers = torch.zeros(b, t)  # [B, T] 1 on reader rows
        for i, (tokens, _, (r0, r1)) in enumerate(part):
            toks[i, :len(tokens)] = torch.as_tensor(list(tokens), dtype=torch.long)
            readers[i, r0:r1] = 1.0
        cos, sin = rope_tables(engine.rope, torch.arange(t))
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        h = engine.embed(toks.reshape(-1))  # [B*T, d]
        kvs, reads = [], torch.zeros(c.num_layers, b, t)
        for layer in range(c.num_layers):
            q, k, v = (x.reshape(x.shape[0], b, t, -1).transpose(0, 1) for x in engine.qkv(layer, h))  # [B, H, T, D]
            kvs.append((k, v))
            q, kr = rotate(q, cos, sin), rotate(k, cos, sin)
            kr, vr = kr.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # [B, Hq, T, D]
            p = ((q @ kr.transpose(2, 3)) * engine.scale).masked_fill(causal, float("-inf")).softmax(-1)  # [B, Hq, T, T]
            if layer in use:
                reads[layer] = (p.float().mean(1) * readers[:, :, None]).sum(1)  # [B, T] per key
            o = (p @ vr).transpose(0, 1).reshape(c.num_heads, b * t, -1)  # [Hq, B*T, D]
            h = engine.mlp(layer, engine.attn_out(layer, h, o))
        for i, (tokens, (s0, s1), (r0, r1)) in enumerate(part):
            per_layer = reads[:, i, s0:s1].clone()
            ctx = ([(rotate(k[i, :, :r0], cos[:r0], sin[:r0]), v[i, :, :r0].clone()) for k, v in kvs]
                   if context else None)
            out.append(Observation([(k[i, :, s0:s1].clone(), v[i, :, s0:s1].clone()) for k, v in kvs],
                                   per_layer.sum(0), per_layer, ctx, (s0, s1) if context else None,
                                   tuple(int(x) for x in list(tokens)[r0:r1]) if context else None))
    return out


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


@dataclass(frozen=True)
class GainCase:
    """A chunk computed in full inside one request, and a stored variant of it.

    context   per layer (K post-RoPE [Hkv, P, D], V [Hkv, P, D]): the request's cache of
              every row before its question (what a blended prefill's `BlendResult.kv`
              holds), the chunk's fresh KV among them at rows `span`
    span      [start, end) rows of the chunk in `context`
    question  the request's question tokens, at rows P.. right after `context`
    stored    per layer (K RoPE-free [Hkv, T, D], V): the stored variant's KV of the chunk
    """

    context: KV
    span: tuple[int, int]
    question: tuple[int, ...]
    stored: KV


def gain_case(seen: Observation, stored: KV) -> GainCase:
    """The `GainCase` of an observation kept with `observe_many(context=True)`."""
    if seen.context is None:
        raise ValueError("observation has no context: build it with observe_many(context=True)")
    return GainCase(seen.context, seen.span, seen.question, stored)


@torch.no_grad()
def fresh_gain(engine, cases: Sequence[GainCase], max_elements: int = 1 << 24) -> list[Tensor]:
    """Per token of each case's chunk [T]: how much of the request's answer that token's
    stale KV costs, measured where it is known (issue 19's learned list).

    The chunk in the request's cache is replaced by the stored variant's KV (rotated to the
    chunk's rows): stale, as a reuse would serve it. Then for every token t alone the
    fresh KV goes back, and the question's rows are run again through every layer over
    that cache. gain(t) = KL(p || p_stale) - KL(p || p_stale, t fresh), floored at 0, where
    p is the question's next-token distribution over the request's own cache. A token the
    answer does not depend on gains nothing however far its KV moved (what CacheBlend's
    deviation, §4.1, cannot tell); the binding token of a chunk that depends on its prefix
    gains most. Cache-Craft §3.2 recomputes the tokens whose cache is most wrong for the
    request; this measures that directly, on the one layer that matters, the output.

    Costs the question's rows times (T + 2) cache variants per case, not a prefill: the
    rows before the question are not recomputed. Cases run in batches of at most
    `max_elements` cached key elements per layer.
    """
    from kvkernels import rope_tables, rotate

    c = engine.cfg
    g = c.num_heads // c.num_kv_heads
    out: list[Tensor] = []
    i = 0
    while i < len(cases):
        # as many cases as fit: cases x variants x Hkv x rows x D per layer
        j, p_max, m_max = i, 0, 0
        while j < len(cases):
            p2 = max(p_max, cases[j].context[0][0].shape[1])
            m2 = max(m_max, cases[j].span[1] - cases[j].span[0])
            if j > i and (j - i + 1) * (m2 + 2) * c.num_kv_heads * p2 * c.head_dim > max_elements:
                break
            p_max, m_max, j = p2, m2, j + 1
        out += _gain_batch(engine, cases[i:j], p_max, m_max, g, rope_tables, rotate)
        i = j
    return out


def _gain_batch(engine, cases: Sequence[GainCase], P: int, M: int, g: int, rope_tables, rotate) -> list[Tensor]:
    c = engine.cfg
    dev, dt = cases[0].context[0][0].device, cases[0].context[0][0].dtype  # the engine's cache
    C, NV = len(cases), M + 2  # variants: token t fresh (t < M), all stale (M), all fresh (M + 1)
    Q = max(len(k.question) for k in cases)
    if Q == 0:
        raise ValueError("a case has no question rows")
    valid = torch.zeros(C, P, dtype=torch.bool)  # [C, P] real context rows
    fresh = torch.ones(C, NV, P, dtype=torch.bool)  # [C, V, P] row served from the request's own KV
    qtok = torch.zeros(C, Q, dtype=torch.long)
    qlen = torch.zeros(C, dtype=torch.long)
    qpos = torch.zeros(C, Q, dtype=torch.long)
    for n, k in enumerate(cases):
        p, (s0, s1) = k.context[0][0].shape[1], k.span
        if not (0 <= s0 < s1 <= p) or len(k.stored) != c.num_layers or k.stored[0][0].shape[1] != s1 - s0:
            raise ValueError(f"case {n}: span {k.span} of {p} rows vs a stored chunk of "
                             f"{k.stored[0][0].shape[1]} tokens")
        valid[n, :p] = True
        m = s1 - s0
        fresh[n, :, s0:s1] = False
        fresh[n, torch.arange(m), s0 + torch.arange(m)] = True
        fresh[n, M + 1, s0:s1] = True
        qtok[n, :len(k.question)] = torch.as_tensor(k.question)
        qlen[n] = len(k.question)
        qpos[n] = p + torch.arange(Q)
    valid, fresh, qtok, qlen, qpos = (x.to(dev) for x in (valid, fresh, qtok, qlen, qpos))
    cos, sin = rope_tables(engine.rope, qpos.reshape(-1))
    cos, sin = cos.view(C, 1, 1, Q, -1), sin.view(C, 1, 1, Q, -1)
    h = engine.embed(qtok[:, None, :].expand(C, NV, Q).reshape(-1))  # [C*V*Q, d]
    keys_ok = torch.cat([valid[:, None, :].expand(C, Q, P),
                         torch.ones(Q, Q, dtype=torch.bool, device=dev).tril()[None].expand(C, Q, Q)],
                        dim=2)  # [C, Q, P+Q]
    for layer in range(c.num_layers):
        K = torch.zeros(C, c.num_kv_heads, P, c.head_dim, dtype=dt, device=dev)
        V = torch.zeros_like(K)
        Ks, Vs = torch.zeros_like(K), torch.zeros_like(K)
        for n, k in enumerate(cases):
            kc, vc = k.context[layer]
            p, (s0, s1) = kc.shape[1], k.span
            K[n, :, :p], V[n, :, :p] = kc, vc
            Ks[n, :, :p], Vs[n, :, :p] = kc, vc
            cs, sn = rope_tables(engine.rope, torch.arange(s0, s1, device=dev))
            sk, sv = (x.to(device=dev, dtype=dt) for x in k.stored[layer])
            Ks[n, :, s0:s1], Vs[n, :, s0:s1] = rotate(sk, cs, sn), sv
        f = fresh[:, :, None, :, None]  # [C, V, 1, P, 1]
        Kmix = torch.where(f, K[:, None], Ks[:, None])  # [C, V, Hkv, P, D]
        Vmix = torch.where(f, V[:, None], Vs[:, None])
        q, k, v = (x.reshape(x.shape[0], C, NV, Q, -1).permute(1, 2, 0, 3, 4) for x in engine.qkv(layer, h))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # [C, V, H, Q, D]
        Ka = torch.cat([Kmix, k], dim=3).repeat_interleave(g, 2)  # [C, V, Hq, P+Q, D]
        Va = torch.cat([Vmix, v], dim=3).repeat_interleave(g, 2)
        att = (q @ Ka.transpose(3, 4)) * engine.scale  # [C, V, Hq, Q, P+Q]
        att = att.masked_fill(~keys_ok[:, None, None], float("-inf")).softmax(-1)
        o = (att @ Va).permute(2, 0, 1, 3, 4).reshape(c.num_heads, C * NV * Q, -1)  # [Hq, C*V*Q, D]
        h = engine.mlp(layer, engine.attn_out(layer, h, o))
    last = h.view(C, NV, Q, -1)[torch.arange(C, device=dev), :, qlen - 1]  # [C, V, d] each case's last question row
    logp = engine.logits(last.reshape(C * NV, -1)).float().log_softmax(-1).view(C, NV, -1)
    ref = logp[:, M + 1:]  # [C, 1, vocab] the request's own answer distribution
    kl = (ref.exp() * (ref - logp)).sum(-1)  # [C, V]
    return [(kl[n, M] - kl[n, :k.span[1] - k.span[0]]).clamp_min(0.0).cpu() for n, k in enumerate(cases)]


__all__ = ["DEFAULT_BUDGET", "Observation", "observe", "observe_many", "GainCase", "gain_case", "fresh_gain", "learned_scores", "kv_deviation", "merge_scores", "order", "allocate", "per_chunk"]
