"""Learned recompute lists: which tokens of a reused chunk to recompute,
measured at the answer of a request that computed the chunk in full.

Pure functions on torch tensors, on the CPU (the engine's plain-torch layer step over batches
of variants of a request's cache).

A chunk's KV depends on what came before it only through some of its tokens (a
pronoun's referent, the token the model keeps a binding on). When a request computes a
chunk in full although a variant of it is stored (behind another prefix), both are at
hand: `fresh_gain` measures, per token, how much of that request's answer the stored
variant's stale KV of the token costs (the answer's KL divergence with the chunk stale,
minus with only that token fresh). That is the quantity Cache-Craft §3.2 recomputes
tokens to reduce, measured at the output instead of estimated from attention (eq. 14)
or from KV deviation on layer 1 (CacheBlend §4.3, HKVD). The scores are stored with the
variant it created (`VariantStats.recompute_scores`), merged over the requests that
computed the chunk (`kvcraft.recompute.merge_scores`), so the next reuse, behind any
prefix, knows which tokens to recompute without computing a layer first.

The default list (`learn`) starts from the top fresh-gain token and adds, greedily, the
tokens whose RECOMPUTE repairs the answer most (`recompute_gain`): a recomputed token
attends to the chunk's other, stale rows, so a binding that reaches the token the answer
reads through other tokens of the chunk (on long chunks, the filler before the profile
sentence) is repaired only when those are recomputed too, which a one-token fresh gain
cannot see (docs/quality.md, the long task).

`kvcraft.recompute.allocate` (shared with the planner, which never imports torch)
spends one prompt-wide budget on the highest scores of all reused chunks, so a chunk
that does not depend on its prefix (a chain head, a distractor) gets nothing and one
that does gets its binding token(s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from engine_adapter.attention import Visibility
from engine_adapter.observe import KV, Observation
from engine_adapter.step import LayerCache, Rotation, Rows, layer_step
from kvkernels import rope_tables, rotate

@dataclass(frozen=True)
class GainCase:
    """A chunk computed in full inside one request, and a stored variant of it.

    context   per layer (K post-RoPE [Hkv, P, D], V [Hkv, P, D]): the request's cache of
              every row before its question (what a blended prefill's `BlendResult.kv`
              holds), the chunk's fresh KV among them at rows `span`
    span      [start, end) rows of the chunk in `context`
    question  the request's question tokens, at rows P.. right after `context`
    stored    per layer (K RoPE-free [Hkv, T, D], V): the stored variant's KV of the chunk
    tokens    the chunk's token ids (`recompute_gain` recomputes rows from them)
    """

    context: KV
    span: tuple[int, int]
    question: tuple[int, ...]
    stored: KV
    tokens: tuple[int, ...] = ()


def gain_case(seen: Observation, stored: KV) -> GainCase:
    """The `GainCase` of an observation kept with `observe_many(context=True)`."""
    if seen.context is None:
        raise ValueError("observation has no context: build it with observe_many(context=True)")
    return GainCase(seen.context, seen.span, seen.question, stored, seen.chunk or ())


@torch.no_grad()
def fresh_gain(engine, cases: Sequence[GainCase], max_elements: int = 1 << 24, stale: bool = False) -> list[Tensor]:
    """Per token of each case's chunk [T]: how much of the request's answer that token's
    stale KV costs, measured where it is known (a request that computed the chunk in full).

    The chunk in the request's cache is replaced by the stored variant's KV (rotated to the
    chunk's rows): stale, as a reuse would serve it. Then for every token t alone the
    fresh KV goes back, and the question's rows are run again through every layer over
    that cache. gain(t) = KL(p || p_stale) - KL(p || p_stale, t fresh), floored at 0, where
    p is the question's next-token distribution over the request's own cache. A token the
    answer does not depend on gains nothing however far its KV moved (what CacheBlend's
    deviation, §4.1, cannot tell); the binding token of a chunk that depends on its prefix
    gains most. Cache-Craft §3.2 recomputes the tokens whose cache is most wrong for the
    request; this measures that directly, on the one layer that matters, the output.

    `stale=True` measures the other side instead, the loss of leaving token t stale in an
    otherwise fresh chunk: loss(t) = KL(p || p_fresh, t stale) (floored at 0). Where the
    answer needs several tokens of a chunk together (each alone repairs nothing), the
    gain of each is small but the loss of each is large; where the chunk holds the
    binding redundantly on several tokens, the reverse.

    Costs the question's rows times (T + 2) cache variants per case, not a prefill: the
    rows before the question are not recomputed. Cases run in batches of at most
    `max_elements` cached key elements per layer.
    """
    c = engine.cfg
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
        out += _gain_batch(engine, cases[i:j], p_max, m_max, stale)
        i = j
    return out


def _gain_batch(engine, cases: Sequence[GainCase], P: int, M: int, stale: bool = False) -> list[Tensor]:
    c = engine.cfg
    dev, dt = cases[0].context[0][0].device, cases[0].context[0][0].dtype  # the engine's cache
    # variants: token t fresh (t < M; with `stale`: every token but t fresh), all stale (M), all fresh (M + 1)
    C, NV = len(cases), M + 2
    Q = max(len(k.question) for k in cases)
    if Q == 0:
        raise ValueError("a case has no question rows")
    fresh = torch.ones(C, NV, P, dtype=torch.bool)  # [C, V, P] row served from the request's own KV
    qtok = torch.zeros(C, Q, dtype=torch.long)
    qlen = torch.zeros(C, dtype=torch.long)
    qpos = torch.zeros(C, Q, dtype=torch.long)
    visible = torch.zeros(C, Q, P + Q, dtype=torch.bool)  # [C, Q, P+Q] real context rows, the question causal
    for n, k in enumerate(cases):
        p, (s0, s1) = k.context[0][0].shape[1], k.span
        if not (0 <= s0 < s1 <= p) or len(k.stored) != c.num_layers or k.stored[0][0].shape[1] != s1 - s0:
            raise ValueError(f"case {n}: span {k.span} of {p} rows vs a stored chunk of "
                             f"{k.stored[0][0].shape[1]} tokens")
        visible[n, :, :p] = True
        m = s1 - s0
        fresh[n, :, s0:s1] = stale
        fresh[n, torch.arange(m), s0 + torch.arange(m)] = not stale
        fresh[n, M, s0:s1] = False
        fresh[n, M + 1, s0:s1] = True
        qtok[n, :len(k.question)] = torch.as_tensor(k.question)
        qlen[n] = len(k.question)
        qpos[n] = p + torch.arange(Q)
    visible[:, :, P:] = torch.ones(Q, Q, dtype=torch.bool).tril()
    fresh, qtok, qlen, qpos, visible = (x.to(dev) for x in (fresh, qtok, qlen, qpos, visible))
    mask = torch.zeros(C, 1, Q, P + Q, dtype=dt, device=dev).masked_fill_(~visible[:, None], float("-inf"))
    # the question's rows at cache rows P.. of every variant, rotated to their positions
    rows = Rows(torch.arange(P, P + Q, device=dev), qpos, Rotation(*_tables(engine, qpos, 2), False),
                Visibility(mask))
    h = engine.embed(qtok[:, None, :].expand(C, NV, Q))  # [C, V, Q, d]
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
        Kc = torch.zeros(C, NV, c.num_kv_heads, P + Q, c.head_dim, dtype=dt, device=dev)
        Vc = torch.zeros_like(Kc)
        Kc[..., :P, :] = torch.where(f, K[:, None], Ks[:, None])  # [C, V, Hkv, P, D]
        Vc[..., :P, :] = torch.where(f, V[:, None], Vs[:, None])
        h = layer_step(engine, layer, h, rows, LayerCache(Kc, Vc, torch.arange(P + Q, device=dev))).h
    last = h[torch.arange(C, device=dev), :, qlen - 1]  # [C, V, d] each case's last question row
    logp = engine.logits(last.reshape(C * NV, -1)).float().log_softmax(-1).view(C, NV, -1)
    ref = logp[:, M + 1:]  # [C, 1, vocab] the request's own answer distribution
    kl = (ref.exp() * (ref - logp)).sum(-1)  # [C, V]
    if stale:
        return [kl[n, :k.span[1] - k.span[0]].clamp_min(0.0).cpu() for n, k in enumerate(cases)]
    return [(kl[n, M] - kl[n, :k.span[1] - k.span[0]]).clamp_min(0.0).cpu() for n, k in enumerate(cases)]


def _tables(engine, pos: Tensor, heads_dims: int) -> tuple[Tensor, Tensor]:
    """RoPE tables at positions [..., R] shaped to rotate [..., V, H, R, D] (`heads_dims` dims
    between the positions' batch dims and the rows: a variant's and a head's, or a head's)."""
    cos, sin = rope_tables(engine.rope, pos.reshape(-1))
    shape = (*pos.shape[:-1], *([1] * heads_dims), pos.shape[-1], -1)
    return cos.view(shape), sin.view(shape)


# Greedy rounds of the default learned list (`learn`): tokens recorded per request and chunk.
DEFAULT_ROUNDS = 4


@torch.no_grad()
def learn(engine, cases: Sequence[GainCase], rounds: int = DEFAULT_ROUNDS, max_elements: int = 1 << 24) -> list[Tensor]:
    """The default learned recompute scores of each case's chunk (what store-back sends as
    `recompute_scores`): `recompute_gain` greedy from the top `fresh_gain` token."""
    return recompute_gain(engine, cases, rounds, max_elements=max_elements)


@torch.no_grad()
def recompute_gain(engine, cases: Sequence[GainCase], rounds: int = 4, first: Sequence[int | None] | None = None,
                   max_elements: int = 1 << 24, min_kl: float = 1e-3, paths: list | None = None) -> list[Tensor]:
    """Per token of each case's chunk [T]: a learned list built greedily by what
    RECOMPUTING tokens repairs (what the long task's bindings through filler need).

    `fresh_gain` puts a token's fresh KV back, as if it had been recomputed over a fresh
    chunk. A reuse recomputes it over the chunk's stale rows instead: if the token's
    binding comes through another token of the chunk (the companion of a "they" chunk
    reads who "they" is from the "they" token, which reads the chunk before), the
    recomputed token reads the stale one and repairs nothing. Here the chunk is served
    stale, as a reuse would, and the chosen rows are recomputed from layer 0 over it (the
    blend's arithmetic: Cache-Craft §3.2's recompute of selected tokens, CacheBlend §4.3's
    selected rows attending to the reused KV); the question's rows then give the
    answer. Greedy: start from `first` (default: each case's top `fresh_gain` token, the
    token the answer reads), then `rounds - 1` times add the token whose recompute
    lowers KL(p || answer) most given the tokens chosen so far. The i-th chosen token
    scores KL_(i-1) - min(KL_j, j >= i) (what recomputing it and the tokens chosen after
    it still repairs; KL_0 = every token stale), every other token 0. A case whose stale
    chunk costs less than `min_kl` scores all 0. The greedy runs every round even once
    the answer is repaired here: the tokens it adds then score little (they rank after
    every token that repaired something) but help where the rest of the prompt is stale
    too (a variant that stopped at 1e-3 nats recomputed half as much; docs/quality.md).

    Costs per round the chunk's T + 2 variants x (chosen + 1 + question) rows through
    every layer, over caches of the request's rows. `paths`, if given, receives each
    case's greedy path (chosen tokens, KL_0..KL_k): the path of fewer rounds is its prefix
    (`path_scores`).
    """
    if any(not k.tokens or len(k.tokens) != k.span[1] - k.span[0] for k in cases):
        raise ValueError("recompute_gain needs each case's chunk tokens (GainCase.tokens)")
    if first is None:
        first = [int(g.argmax()) if len(g) and float(g.max()) > 0 else None
                 for g in fresh_gain(engine, cases, max_elements)]
    chosen: list[list[int]] = [[] for _ in cases]
    kls: list[list[float]] = [[] for _ in cases]  # KL after recomputing the first i chosen tokens
    live = list(range(len(cases)))
    for r in range(rounds):
        if not live:
            break
        got = _recompute_rounds(engine, [cases[n] for n in live], [chosen[n] for n in live], max_elements)
        still = []
        for n, (base, each) in zip(live, got):
            if r == 0:
                kls[n].append(base)
                if base < min_kl:
                    continue
            m = len(each)
            if r == 0 and first[n] is not None:
                u = int(first[n])
            else:
                each = each.clone()
                each[chosen[n]] = float("inf")
                u = int(each.argmin())
            chosen[n].append(u)
            kls[n].append(float(each[u]))
            if len(chosen[n]) < m:
                still.append(n)
        live = still
    if paths is not None:
        paths.extend(zip(chosen, kls))
    return [path_scores(chosen[n], kls[n], k.span[1] - k.span[0], rounds) for n, k in enumerate(cases)]


def path_scores(chosen: Sequence[int], kls: Sequence[float], tokens: int, rounds: int) -> Tensor:
    """The scores of `recompute_gain` with `rounds` from a greedy path of at least as many."""
    chosen, kls = list(chosen)[:rounds], list(kls)[:rounds + 1]
    sc = torch.zeros(tokens)
    for i, u in enumerate(chosen):
        sc[u] = max(kls[i] - min(kls[i + 1:]), 0.0)
    return sc


def _recompute_rounds(engine, cases: Sequence[GainCase], chosen: Sequence[Sequence[int]],
                      max_elements: int) -> list[tuple[float, Tensor]]:
    """(KL with `chosen` recomputed, [T] KL with `chosen` + token t recomputed) per case,
    in batches of at most `max_elements` cache elements per layer."""
    c = engine.cfg
    out: list[tuple[float, Tensor]] = []
    i = 0
    while i < len(cases):
        j, p_max, m_max = i, 0, 0
        while j < len(cases):
            p2 = max(p_max, cases[j].context[0][0].shape[1] + len(cases[j].question))
            m2 = max(m_max, cases[j].span[1] - cases[j].span[0])
            if j > i and (j - i + 1) * (m2 + 2) * c.num_heads * p2 * c.head_dim > max_elements:
                break
            p_max, m_max, j = p2, m2, j + 1
        out += _recompute_batch(engine, cases[i:j], chosen[i:j])
        i = j
    return out


def _recompute_batch(engine, cases: Sequence[GainCase], chosen: Sequence[Sequence[int]]) -> list[tuple[float, Tensor]]:
    c = engine.cfg
    dev, dt = cases[0].context[0][0].device, cases[0].context[0][0].dtype
    C = len(cases)
    M = max(k.span[1] - k.span[0] for k in cases)
    Q = max(len(k.question) for k in cases)
    R = max(len(s) for s in chosen) + 1  # recomputed chunk rows per variant: the chosen, then the candidate
    NV = M + 2  # variants: chosen + token t (t < M), chosen alone (M), the request's own cache (M + 1)
    P = max(k.context[0][0].shape[1] for k in cases) + Q  # cache rows: the context, then the question
    scratch = P  # one more cache row: where the rows that write nothing write (no row reads it)
    rows = R + Q
    pos = torch.zeros(C, NV, rows, dtype=torch.long)  # each computed row's position (its cache row)
    write = torch.zeros(C, NV, rows, dtype=torch.bool)  # the row's K/V goes into the variant's cache
    toks = torch.zeros(C, NV, rows, dtype=torch.long)
    limit = torch.zeros(C, dtype=torch.long)  # cache rows < limit are real
    last = torch.zeros(C, dtype=torch.long)
    for n, (k, sel) in enumerate(zip(cases, chosen)):
        p, (s0, s1), m = k.context[0][0].shape[1], k.span, k.span[1] - k.span[0]
        q = len(k.question)
        limit[n] = p + q
        last[n] = R + q - 1
        qt = torch.as_tensor(k.question, dtype=torch.long)
        ct = torch.as_tensor(k.tokens, dtype=torch.long)
        toks[n, :, R:R + q] = qt
        pos[n, :, R:] = p + torch.arange(Q)
        write[n, :, R:R + q] = True
        for v in range(M + 1):
            slots = list(sel) + ([v] if v < m and v not in sel else [])
            for r_, t in enumerate(slots):
                toks[n, v, r_], pos[n, v, r_], write[n, v, r_] = ct[t], s0 + t, True
    pos, write, toks, limit, last = (x.to(dev) for x in (pos, write, toks, limit, last))
    keyp = torch.arange(P + 1, device=dev)
    allowed = (keyp <= pos[..., None]) & (keyp < limit[:, None, None, None])  # [C, NV, rows, P+1]
    mask = torch.zeros(allowed.shape, dtype=dt, device=dev).masked_fill_(~allowed, float("-inf"))
    steps = Rows(torch.where(write, pos, scratch), pos, Rotation(*_tables(engine, pos, 1), False), Visibility(mask))
    h = engine.embed(toks)  # [C, NV, rows, d]
    for layer in range(c.num_layers):
        Kc = torch.zeros(C, NV, c.num_kv_heads, P + 1, c.head_dim, dtype=dt, device=dev)
        Vc = torch.zeros_like(Kc)
        for n, k in enumerate(cases):
            kc, vc = k.context[layer]  # [Hkv, p, D]
            p, (s0, s1) = kc.shape[1], k.span
            Kc[n, :, :, :p], Vc[n, :, :, :p] = kc, vc
            cs, sn = rope_tables(engine.rope, torch.arange(s0, s1, device=dev))
            sk, sv = (x.to(device=dev, dtype=dt) for x in k.stored[layer])
            Kc[n, :M + 1, :, s0:s1], Vc[n, :M + 1, :, s0:s1] = rotate(sk, cs, sn), sv
        h = layer_step(engine, layer, h, steps, LayerCache(Kc, Vc, keyp)).h
    hl = h[torch.arange(C, device=dev), :, last]  # [C, NV, d]
    logp = engine.logits(hl.reshape(C * NV, -1)).float().log_softmax(-1).view(C, NV, -1)
    ref = logp[:, M + 1:]
    kl = (ref.exp() * (ref - logp)).sum(-1).cpu()  # [C, NV]
    return [(float(kl[n, M]), kl[n, :k.span[1] - k.span[0]].clamp_min(0.0)) for n, k in enumerate(cases)]
