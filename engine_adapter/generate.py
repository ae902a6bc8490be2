"""Greedy decoding that continues a prefill: the answer after the first token.

A prefill (`LlamaEngine.prefill`, or `blend_prefill` over reused chunk KV) ends with the
logits of the last prompt position and the per-layer cache of the prompt (K post-RoPE).
`greedy` takes those two and decodes token by token, each new token's K/V appended to a
copy of that cache, until a stop token or `max_new_tokens`. Over a blended cache the
answer is what the reused KV makes of it: the quantity CacheBlend's and Cache-Craft's
quality numbers are about.

Per token (one row at position p): embed, then per layer the layer step (`step.layer_step`)
over the cache's rows 0..p (its K/V written at row p; no mask: one query sees every earlier
row); then the vocabulary projection and argmax. The same step as the prefill, so a full
prefill then `greedy` matches transformers' `generate(do_sample=False)`.

Stop tokens come from the model folder (`stop_tokens`: generation_config.json's
`eos_token_id`, an id or a list, else config.json's).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch
from torch import Tensor

from engine_adapter.attention import EVERY_KEY
from engine_adapter.llama import LlamaEngine
from engine_adapter.selection import Rescale
from engine_adapter.step import LayerCache, Rotation, Rows, layer_step
from kvkernels import rope_tables


@dataclass(frozen=True)
class Generation:
    tokens: tuple[int, ...]  # generated ids, the first from the prefill's logits; a stop token ends it, included
    stopped: bool  # True: a stop token ended it; False: max_new_tokens did
    decode_s: float  # wall time of the decode steps (after the prefill's first token)


def stop_tokens(model_dir: str | Path) -> frozenset[int]:
    """The model's stop ids: `eos_token_id` of generation_config.json, else of config.json."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return frozenset([eos] if isinstance(eos, int) else eos)
    return frozenset()


@torch.no_grad()
def greedy(engine: LlamaEngine, logits: Tensor, kv: list[tuple[Tensor, Tensor]], max_new_tokens: int,
           stop: Iterable[int] = (), feed: Sequence[int] = (), rescale: Rescale | None = None) -> Generation:
    """Greedy tokens after a prefill of N tokens at positions 0..N-1.

    logits: the last prompt position's, [V] (or [..., V]: the last row is used);
    kv: per layer (K post-RoPE [Hkv, N, D], V [Hkv, N, D]), e.g. `BlendResult.kv`. Not modified.
    feed: teacher forcing: these tokens are fed back in place of the model's own (up to
    len(feed) steps); the tokens returned are still its own, each its pick after feed[:i].
    rescale: each new token reads the chunks encoded apart as APE does (`policies.ape`).
    """
    if max_new_tokens < 1:
        return Generation((), False, 0.0)
    stop = frozenset(stop)
    c = engine.cfg
    n = kv[0][0].shape[1]
    cap = n + max_new_tokens - 1  # the last token is never fed back
    cache = []
    for k, v in kv:  # [Hkv, cap, D] each: the prompt's rows, then room for the answer's
        ck = k.new_empty(c.num_kv_heads, cap, c.head_dim)
        cv = v.new_empty(c.num_kv_heads, cap, c.head_dim)
        ck[:, :n], cv[:, :n] = k, v
        cache.append((ck, cv))
    out = [int(logits.reshape(-1, logits.shape[-1])[-1].argmax())]
    t0 = time.perf_counter()
    for pos in range(n, cap if not feed else min(cap, n + len(feed) - 1)):
        fed = feed[pos - n] if feed else out[-1]
        if fed in stop:
            break
        at, keys = torch.tensor([pos]), torch.arange(pos + 1)
        rows = Rows(at, at, Rotation(*rope_tables(engine.rope, at), engine.triton), EVERY_KEY)
        h = engine.embed(torch.tensor([fed]))  # [1, d]
        for layer, (ck, cv) in enumerate(cache):
            h = layer_step(engine, layer, h, rows, LayerCache(ck[:, :pos + 1], cv[:, :pos + 1], keys),
                           rescale=rescale).h
        out.append(int(engine.logits(h)[0].argmax()))
    return Generation(tuple(out), out[-1] in stop, time.perf_counter() - t0)


__all__ = ["Generation", "greedy", "stop_tokens"]
