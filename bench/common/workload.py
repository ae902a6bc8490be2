"""Seeded synthetic RAG traces (multi-turn, Zipf chunk popularity).

Model:
  * corpus of `corpus` chunks, each with a token count uniform in [min_tokens,
    max_tokens]; chunk popularity is Zipf(s) over a random permutation of the corpus.
  * `conversations` conversations with 1 + Geometric(mean_turns - 1) turns; up to
    `active` conversations are interleaved (a random active one takes the next turn).
  * each turn retrieves k distinct chunks. In a later turn each slot first tries,
    with probability p_repeat, a chunk of the conversation's earlier turns (topic
    locality, CRAFT §3.2); otherwise it draws from the Zipf popularity.
  * retriever order: chunks are sorted by a per-request relevance score
    score = U(0,1) + order_bias * popularity, where popularity is 1 for the most
    popular chunk and falls as 1/log2(1 + rank). order_bias > 0 models retrievers
    whose top hits are usually the popular passages (this is what gives prefix
    caching its small share).

Defaults are calibrated (see `trace_stats`) to CRAFT's observations: ~43% of
retrieved chunks seen in an earlier request, ~11% prefix-aligned (CRAFT §3.1 Prefix
metric), ~21% of a later turn's chunks already in its conversation (CRAFT §3.2).
`HIGH_REUSE` is a preset with >= 85% of retrieved chunks seen before.

    python -m kvbench.common.workload                 # print the default trace's statistics
    python -m kvbench.common.workload --preset high-reuse
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import numpy as np

from kvbench.common.args import count


@dataclass(frozen=True)
class WorkloadConfig:
    seed: int = 0
    corpus: int = 300_000
    zipf_s: float = 0.88
    k: int = 5
    conversations: int = 2_000
    mean_turns: float = 2.0
    p_repeat: float = 0.31
    order_bias: float = 1.0
    active: int = 16
    min_tokens: int = 128
    max_tokens: int = 512
    question_tokens: tuple[int, int] = (16, 64)


DEFAULT = WorkloadConfig()
HIGH_REUSE = replace(DEFAULT, corpus=3_000, zipf_s=1.1)
PRESETS = {"default": DEFAULT, "high-reuse": HIGH_REUSE}


@dataclass(frozen=True, slots=True)
class Request:
    conv_id: str           # "" for a one-turn conversation
    turn: int              # 0 for the first turn
    chunks: tuple[tuple[str, int], ...]  # (chunk key, token count), retriever order
    question_tokens: int


def chunk_key_of(i: int) -> str:
    """Stand-in for a content hash: 32 hex chars, like kvcraft.keys.chunk_key."""
    return f"{i:032x}"


def generate(cfg: WorkloadConfig = DEFAULT) -> list[Request]:
    return list(iter_requests(cfg))


def iter_requests(cfg: WorkloadConfig = DEFAULT) -> Iterator[Request]:
    rng = np.random.default_rng(cfg.seed)
    n = cfg.corpus
    tokens = rng.integers(cfg.min_tokens, cfg.max_tokens + 1, size=n)
    rank_of = rng.permutation(n)                    # chunk -> popularity rank
    chunk_at_rank = np.argsort(rank_of)
    w = 1.0 / np.arange(1, n + 1) ** cfg.zipf_s
    cdf = np.cumsum(w / w.sum())
    popularity = 1.0 / np.log2(2.0 + rank_of)       # 1 for rank 0, decays slowly
    keys = [chunk_key_of(i) for i in range(n)]

    turns_left = {}
    history: dict[int, list[int]] = {}
    next_conv = 0
    active: list[int] = []
    while next_conv < cfg.conversations or active:
        while len(active) < cfg.active and next_conv < cfg.conversations:
            c = next_conv
            next_conv += 1
            p = 1.0 / max(1.0, cfg.mean_turns)
            turns_left[c] = int(rng.geometric(p))
            history[c] = []
            active.append(c)
        c = active[int(rng.integers(len(active)))]
        hist = history[c]
        turn = len(hist) // cfg.k if hist else 0
        picked: list[int] = []
        pool = list(dict.fromkeys(hist))
        for _ in range(cfg.k):
            choice = -1
            if hist and rng.random() < cfg.p_repeat:
                cands = [x for x in pool if x not in picked]
                if cands:
                    choice = cands[int(rng.integers(len(cands)))]
            while choice < 0 or choice in picked:
                choice = int(chunk_at_rank[min(n - 1, int(np.searchsorted(cdf, rng.random())))])
            picked.append(choice)
        score = rng.random(cfg.k) + cfg.order_bias * popularity[picked]
        order = [picked[i] for i in np.argsort(-score, kind="stable")]
        hist.extend(order)
        turns_left[c] -= 1
        conv_id = f"conv-{c}" if (turns_left[c] > 0 or turn > 0) else ""
        lo, hi = cfg.question_tokens
        yield Request(conv_id, turn, tuple((keys[x], int(tokens[x])) for x in order),
                      int(rng.integers(lo, hi + 1)))
        if turns_left[c] <= 0:
            active.remove(c)
            del history[c], turns_left[c]


def trace_stats(trace: Sequence[Request], window: int = 1000) -> dict[str, float]:
    """CRAFT §3.1-3.2 statistics of a trace.

    seen_before: share of retrieved chunks that appeared in any earlier request.
    prefix_aligned: CRAFT "Prefix" = mean over requests of max_j LCP(R_i, R_j) / k.
    total_overlap: CRAFT "Total" = mean over requests of max_j |R_i ∩ R_j| / k, over
      the previous `window` requests.
    conv_dup_later_turns: share of a later turn's chunks already retrieved earlier
      in its conversation (CRAFT §3.2); conv_dup_all_turns: the same over all turns.
    """
    seen: set[str] = set()
    prefixes: set[tuple[str, ...]] = set()
    by_chunk: dict[str, list[int]] = {}
    conv_sent: dict[str, set[str]] = {}
    n_chunks = seen_hits = 0
    prefix_sum = total_sum = 0.0
    later_chunks = later_dups = 0
    for i, r in enumerate(trace):
        ks = [k for k, _ in r.chunks]
        k = len(ks) or 1
        n_chunks += len(ks)
        seen_hits += sum(1 for x in ks if x in seen)
        if i:
            lcp = 0
            while lcp < len(ks) and tuple(ks[: lcp + 1]) in prefixes:
                lcp += 1
            prefix_sum += lcp / k
            overlap = Counter(j for x in set(ks) for j in by_chunk.get(x, ()) if j >= i - window)
            total_sum += (max(overlap.values()) if overlap else 0) / k
        seen.update(ks)
        prefixes.update(tuple(ks[:j]) for j in range(1, len(ks) + 1))
        for x in set(ks):
            by_chunk.setdefault(x, []).append(i)
        if r.conv_id:
            sent = conv_sent.setdefault(r.conv_id, set())
            if r.turn > 0:
                later_chunks += len(ks)
                later_dups += sum(1 for x in ks if x in sent)
            sent.update(ks)
    m = max(1, len(trace) - 1)
    conv_turns = sum(len(r.chunks) for r in trace if r.conv_id)
    return {
        "requests": float(len(trace)),
        "retrieved_chunks": float(n_chunks),
        "seen_before": seen_hits / max(1, n_chunks),
        "prefix_aligned": prefix_sum / m,
        "total_overlap": total_sum / m,
        "conv_dup_later_turns": later_dups / max(1, later_chunks),
        "conv_dup_all_turns": later_dups / max(1, conv_turns),
        "multi_turn_requests": sum(1 for r in trace if r.conv_id) / max(1, len(trace)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbench.common.workload", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="default")
    ap.add_argument("--seed", type=count(0), default=0)
    ap.add_argument("--conversations", type=count())
    args = ap.parse_args(argv)
    cfg = replace(PRESETS[args.preset], seed=args.seed)
    if args.conversations:
        cfg = replace(cfg, conversations=args.conversations)
    for name, v in trace_stats(generate(cfg)).items():
        print(f"{name:24s} {v:10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
