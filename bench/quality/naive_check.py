"""Full prefill vs naive chunk-KV reuse on held-out questions, transformers only.

    kvcraft bench naive-check --n 500

Naive reuse (CacheBlend's "full KV reuse"): each chunk's KV is computed ALONE,
positions from 0 and no prefix; its keys are re-rotated to the chunk's real
offset in the prompt; the chunk caches are concatenated into one DynamicCache
and the question is prefilled on top of it, then the answer is decoded greedily.
Only the positions are fixed; the cross-chunk attention a chunk would have had
is missing, which is exactly what blending must restore.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from transformers import DynamicCache, LlamaForCausalLM

from kvbench import results
from kvbench.common.args import count

from . import data, longdata, modeling

MAX_ANSWER_TOKENS = 4


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_shift(keys: torch.Tensor, shift: int, model: LlamaForCausalLM) -> torch.Tensor:
    """Move keys already rotated at positions p to p + shift.

    RoPE is a rotation by angle pos * inv_freq, so R(p + s) = R(s) R(p): apply the
    rotate-half formula once more with angle s. keys: [B, kv_heads, T, head_dim].
    """
    rotary = model.model.rotary_emb
    pos = torch.full((1, 1), shift, dtype=torch.long)
    cos, sin = rotary(keys, pos)  # [1, 1, head_dim]
    cos, sin = cos[:, None].to(keys.dtype), sin[:, None].to(keys.dtype)  # [1, 1, 1, head_dim]
    return keys * cos + rotate_half(keys) * sin


@torch.no_grad()
def chunk_cache_alone(model: LlamaForCausalLM, ids: list[int]) -> DynamicCache:
    """KV of one chunk computed with no prefix, positions 0..T-1."""
    cache = DynamicCache()
    x = torch.tensor([ids])
    model(input_ids=x, position_ids=torch.arange(len(ids))[None], past_key_values=cache, use_cache=True)
    return cache


@torch.no_grad()
def naive_reuse_cache(model: LlamaForCausalLM, chunk_ids: list[list[int]]) -> tuple[DynamicCache, int]:
    """Concatenate per-chunk caches, each re-rotated to its offset; returns (cache, length)."""
    per_chunk = [chunk_cache_alone(model, c) for c in chunk_ids]
    merged = DynamicCache()
    for layer in range(model.config.num_hidden_layers):
        keys, values, offset = [], [], 0
        for ids, cache in zip(chunk_ids, per_chunk):
            keys.append(rope_shift(cache.layers[layer].keys, offset, model))
            values.append(cache.layers[layer].values)
            offset += len(ids)
        merged.update(torch.cat(keys, dim=2), torch.cat(values, dim=2), layer)
    return merged, offset


@torch.no_grad()
def full_prefill_cache(model: LlamaForCausalLM, chunk_ids: list[list[int]]) -> tuple[DynamicCache, int]:
    """One causal pass over all chunks (the reference)."""
    ids = [t for c in chunk_ids for t in c]
    cache = DynamicCache()
    model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return cache, len(ids)


@torch.no_grad()
def greedy_answer(model: LlamaForCausalLM, cache: DynamicCache, start: int, question_ids: list[int],
                  eos_id: int, max_new: int = MAX_ANSWER_TOKENS) -> list[int]:
    """Prefill the question on top of ``cache`` at positions start.., then decode greedily."""
    ids = list(question_ids)
    pos = start
    out: list[int] = []
    for _ in range(max_new):
        x = torch.tensor([ids])
        p = torch.arange(pos, pos + len(ids))[None]
        logits = model(input_ids=x, position_ids=p, past_key_values=cache, use_cache=True).logits
        nxt = int(logits[0, -1].argmax())
        pos += len(ids)
        out.append(nxt)
        if nxt == eos_id:
            break
        ids = [nxt]
    return out


def answer(model: LlamaForCausalLM, tok, ex: data.Example, mode: str) -> str:
    """Decoded answer text for ``ex`` under ``mode`` in {"full", "naive"}."""
    enc = modeling.encode(tok, ex)
    chunks = [list(c) for c in enc.chunk_ids]
    build = full_prefill_cache if mode == "full" else naive_reuse_cache
    cache, start = build(model, chunks)
    out = greedy_answer(model, cache, start, list(enc.question_ids), tok.eos_token_id)
    if out and out[-1] == tok.eos_token_id:
        return tok.decode(out[:-1]).strip()
    return tok.decode(out).strip() + " <no-eos>"


def evaluate(model: LlamaForCausalLM, tok, examples: list[data.Example],
             modes: tuple[str, ...] = ("full", "naive")) -> dict[str, dict[str, float]]:
    """Exact-match accuracy per mode, overall and per question kind."""
    result: dict[str, dict[str, float]] = {}
    for mode in modes:
        hits: dict[str, list[int]] = {}
        for ex in examples:
            ok = int(answer(model, tok, ex, mode) == ex.answer)
            hits.setdefault("all", []).append(ok)
            hits.setdefault(ex.kind, []).append(ok)
        result[mode] = {k: sum(v) / len(v) for k, v in sorted(hits.items())}
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    ap = argparse.ArgumentParser(prog="kvcraft bench naive-check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=("short", "long"), default="short",
                    help="short: the first task (data); long: the long task (longdata)")
    ap.add_argument("--model", default=None, help="default: the task's committed model")
    ap.add_argument("--n", type=count(), default=500, help="held-out examples")
    ap.add_argument("--seed", type=count(0), default=1,
                    help="held-out draw; 1 by default: training picks its checkpoint on the default draw")
    ap.add_argument("--threads", type=count(), default=1)
    results.add_argument(ap, "naive-check")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    task = data if args.task == "short" else longdata
    model, tok = modeling.load(args.model or (modeling.MODEL_DIR if args.task == "short" else modeling.LONG_MODEL_DIR))
    t0 = time.time()
    res = evaluate(model, tok, task.examples("heldout", args.n, seed=args.seed))
    res["n"] = args.n
    res["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(res, indent=1))
    results.save("naive-check", argv, {"task": args.task, "seed": args.seed, **res}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
