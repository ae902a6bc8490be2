"""What a full computation of a chunk shows: its KV, what the question read of each of
its tokens, and how far its KV moves between two prefixes.

Pure functions on torch tensors, on the CPU (the engine's plain-torch layer step with a
batch of prompts).

`observe` / `observe_many` run full causal prefills and keep a chunk's KV (K RoPE-free)
and the attention the question's rows put on each of its tokens (Cache-Craft eq. 15, per
token); `observe_many(context=True)` also keeps the request's cache before the question,
from which `learned.gain_case` measures what the chunk's tokens are worth to the answer.
`kv_deviation` (CacheBlend §4.1 offline) and `learned_scores` = deviation x what the
question read are measured beside the learned lists (`engine_adapter.learned`) in
`kvbench.quality.selection` and kept as references.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from engine_adapter.attention import CAUSAL
from engine_adapter.step import LayerCache, Rotation, Rows, layer_step
from kvkernels import rope_tables

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
    # with observe_many(context=True): the request as a `learned.GainCase` against a stored variant
    # (per layer K post-RoPE [Hkv, P, D], V of the rows before the question; the question)
    context: list[tuple[Tensor, Tensor]] | None = None
    span: tuple[int, int] | None = None
    question: tuple[int, ...] | None = None
    chunk: tuple[int, ...] | None = None  # the chunk's token ids (with context=True)


class _PerPrompt:
    """What each prompt of a batch read of each key [B, T] (`attention.attend`'s reads)."""

    def __init__(self, b: int, t: int) -> None:
        self.sums = torch.zeros(b, t)

    def add(self, x: Tensor) -> None:
        self.sums += x


@torch.no_grad()
def observe(engine, tokens: Sequence[int], span: tuple[int, int], readers: tuple[int, int],
            layers: Sequence[int] | None = None) -> Observation:
    """Full causal prefill of `tokens`; the KV of rows `span` (a chunk) and how much rows
    `readers` (the question) attend to each of them: attention probabilities averaged over
    heads, summed over reader rows and `layers` (default: every layer but the first).

    Cache-Craft eq. 15 measures the question's attention per chunk (inter(C_i, U)) to
    find the focused chunks; `received` is the same quantity per token. The engine's own
    layer step (`step.layer_step`), asked for the readers' reads; spans are [start, end) rows.
    """
    return observe_many(engine, [(tokens, span, readers)], layers)[0]


Request = tuple[Sequence[int], tuple[int, int], tuple[int, int]]  # tokens, chunk span, reader rows


@torch.no_grad()
def observe_many(engine, requests: Sequence[Request], layers: Sequence[int] | None = None,
                 batch: int = 256, context: bool = False) -> list[Observation]:
    """`observe` for many (tokens, span, readers) at once: right-padded batches of full
    causal prefills (a real row never sees a pad after it), each layer step over all the
    prompts of a batch together. Empty `readers` give zero reads: the chunk's KV alone (a
    variant computed behind `tokens[:span[0]]`). What the quality benchmark and its CI test use
    to build thousands of variants in seconds. `context=True` also keeps what `learned.gain_case`
    needs: the rows before the readers (the question, which must be the last rows).
    """
    c = engine.cfg
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
        pos = torch.arange(t)
        rows = Rows(pos, pos, Rotation(*rope_tables(engine.rope, pos), False), CAUSAL)
        h = engine.embed(toks)  # [B, T, d]
        kvs, reads = [], torch.zeros(c.num_layers, b, t)
        for layer in range(c.num_layers):
            seen = _PerPrompt(b, t) if layer in use else None
            step = layer_step(engine, layer, h, rows, LayerCache(None, None, None), reads=seen, reads_rows=readers)
            _, k, v = step.qkv.split([c.num_heads, c.num_kv_heads, c.num_kv_heads], dim=-3)  # [B, Hkv, T, D] pre-RoPE
            kvs.append((k, v, step.K))
            if seen is not None:
                reads[layer] = seen.sums / c.num_heads  # the mean over heads
            h = step.h
        for i, (tokens, (s0, s1), (r0, r1)) in enumerate(part):
            per_layer = reads[:, i, s0:s1].clone()
            ctx = [(kr[i, :, :r0].clone(), v[i, :, :r0].clone()) for _, v, kr in kvs] if context else None
            out.append(Observation([(k[i, :, s0:s1].clone(), v[i, :, s0:s1].clone()) for k, v, _ in kvs],
                                   per_layer.sum(0), per_layer, ctx, (s0, s1) if context else None,
                                   tuple(int(x) for x in list(tokens)[r0:r1]) if context else None,
                                   tuple(int(x) for x in list(tokens)[s0:s1]) if context else None))
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
