"""Which tokens must be recomputed? Accuracy of blended prefill by token selection, in-process.

    python -m kvbench.quality.selection --examples 300

Every chunk's stored variant is computed behind one chunk of ANOTHER prompt (as an
earlier request would have left it), so a reused "they" chunk is bound to a stranger.
Then each prompt is prefilled through the adapter's blend (`blend_prefill`: RoPE
re-rotation, selective attention, HKVD) under:
  - the policies: full, naive, cacheblend at several r, Cache-Craft's top-N tokens by
    inter-attention (eq. 14) at several fractions of each chunk;
  - fixed token sets, the same positions in every chunk, to find where this model keeps
    the cross-chunk binding (`fixed([-2])` = the companion named at the chunk's end).
No service and no planner: this isolates token selection from everything else
(`kvbench.quality.evaluate` runs the same model through the real service).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor

from engine_adapter import LlamaEngine, Policy
from engine_adapter.policy import CacheBlend, ReusePolicy
from engine_adapter.learned import DEFAULT_ROUNDS, path_scores
from engine_adapter.observe import kv_deviation
from engine_adapter.blend import blend_prefill
from engine_adapter.probe import TRUSTED
from engine_adapter.prompt import Segment
from engine_adapter.source import InMemoryLayerSource
from kvcraft.recompute import DEFAULT_BUDGET, allocate, per_chunk
from kvbench.quality import longdata
from kvbench.quality.modeling import LONG_MODEL_DIR, MODEL_DIR
# the prompts: re-exported, `selection.prompts` / `selection.load_lists` stay where they were
from kvbench.quality.selection_prompts import TASKS, Prompt, load_lists, prompts, save_lists  # noqa: F401


Pick = Callable[[Prompt], Mapping[int, Sequence[int]]]  # prompt -> chunk index -> tokens to recompute


def no_tokens(p: Prompt) -> dict[int, tuple[int, ...]]:
    return {}


def top_inter_attention(fraction: float) -> Pick:
    """Cache-Craft eq. 14: per chunk the ceil(fraction |C_j|) tokens with the most attention
    to prior chunks, measured when the stored variant was computed."""
    return lambda p: per_chunk({j: v.stats.token_inter_attention for j, v in p.stored.items()}, fraction)


def fixed(positions: Sequence[int]) -> Pick:
    """The same token positions in every chunk (negative = from the chunk's end)."""
    return lambda p: {j: sorted({i % len(c) for i in positions}) for j, c in enumerate(p.chunks)}


_IDS = {w: i for i, w in enumerate(longdata.vocabulary())}  # shared words have the same ids in both tasks


def profile(chunk: Sequence[int]) -> tuple[str, int, int]:
    """(kind, start, end) of a chunk's profile sentence: "they" ("they live in C with Y ."),
    "meet" ("meet X . she lives in C with Y .") or "weather" ("the weather in C was cold .")."""
    c = list(chunk)
    if _IDS["they"] in c:
        s = c.index(_IDS["they"])
        return "they", s, s + 7
    if _IDS["meet"] in c:
        s = c.index(_IDS["meet"])
        return "meet", s, s + 10
    s = c.index(_IDS["weather"]) - 1
    return "weather", s, s + 7


ORACLES = ("they token", "companion", "they + companion", "they + city", "they sentence", "they sentence and after", "they sentence and before",
           "whole they chunk", "previous chunk's profile", "they sentence + previous profile")


def oracle(what: str) -> Pick:
    """Token sets chosen knowing the task (a diagnosis, not a method): per "they" chunk
    (the chunks whose KV depends on the chunk before them), its "they" token, its profile
    sentence, the sentence and every token after / before it, the whole chunk, or the
    profile sentence of the chunk before it."""
    if what not in ORACLES:
        raise ValueError(f"unknown oracle {what!r}")

    def pick(p: Prompt) -> dict[int, list[int]]:
        out: dict[int, set[int]] = {}
        for j, c in enumerate(p.chunks):
            kind, s, e = profile(c)
            if kind != "they":
                continue
            mine = out.setdefault(j, set())
            if what == "they token":
                mine.add(s)
            elif what == "companion":
                mine.add(s + 5)
            elif what == "they + companion":
                mine.update((s, s + 5))
            elif what == "they + city":
                mine.update((s, s + 3))
            elif what in ("they sentence", "they sentence + previous profile"):
                mine.update(range(s, e))
            elif what == "they sentence and after":
                mine.update(range(s, len(c)))
            elif what == "they sentence and before":
                mine.update(range(0, e))
            elif what == "whole they chunk":
                mine.update(range(len(c)))
            if what in ("previous chunk's profile", "they sentence + previous profile") and j > 0:
                _, ps, pe = profile(p.chunks[j - 1])
                out.setdefault(j - 1, set()).update(range(ps, pe))
        return {j: sorted(v) for j, v in out.items()}
    return pick


def before(scores: Tensor, window: int) -> Tensor:
    """Each token's score also given, decayed, to the `window` tokens before it:
    s'(t) = max over u in [t, t + window] of s(u) (1 - (u - t) / (window + 1)), so a
    selected token brings the tokens its binding may come through (they precede it:
    attention is causal), after itself."""
    out = scores.clone()
    for d in range(1, window + 1):
        out[:-d] = torch.maximum(out[:-d], scores[d:] * (1 - d / (window + 1)))
    return out


def learned(budget: float, score: str = "read x deviation", layers: Sequence[int] | None = None,
            spread: str = "prompt", window: int = 0, rounds: int = 4) -> Pick:
    """A learned per-variant list (`engine_adapter.learned`): each stored variant's tokens
    scored from the second request that computed the chunk in full (`Prompt.observed`):

      "read x deviation"  what that request's question read from the token times how far
                          the token's KV moved from the stored variant's (`learned_scores`)
      "deviation"         the KV move alone (CacheBlend §4.1, measured offline)
      "deviation alone"   the move between the stored variant and the chunk computed alone
      "read"              what the question read alone
      "gain"              the answer's loss from the token's stale KV (`fresh_gain`),
                          merged over every later request that computed the chunk

    At reuse the budget goes to the top scores of the whole prompt (`spread="prompt"`) or
    to every chunk alike (`"chunk"`, Cache-Craft's per-chunk N)."""
    if score not in ("read x deviation", "deviation", "deviation alone", "read", "gain", "loss", "gain or loss", "recompute gain", "default"):
        raise ValueError(f"unknown score {score!r}")

    def one(p: Prompt, j: int) -> Tensor:
        if score == "gain":
            return p.gains[j]
        if score == "loss":
            return p.losses[j]
        if score == "default":  # what store-back learns (`learned.learn`)
            return p.lists[j]
        if score == "recompute gain":  # greedy paths of `rounds`, merged (max) over the observing requests
            return torch.stack([path_scores(c, k, len(p.chunks[j]), rounds) for c, k in p.paths[j]]).amax(0)
        if score == "gain or loss":
            return torch.maximum(p.gains[j], p.losses[j])
        stored, seen = p.stored[j].kv, p.observed[j]
        if score == "read":
            return seen.received
        if score == "deviation alone":
            return kv_deviation(stored, p.alone[j].kv, layers)
        dev = kv_deviation(stored, seen.kv, layers)
        return dev * seen.received if score == "read x deviation" else dev

    def pick(p: Prompt) -> Mapping[int, Sequence[int]]:
        scores = {j: (before(one(p, j), window) if window else one(p, j)).tolist() for j in p.stored}
        return allocate(scores, budget) if spread == "prompt" else per_chunk(scores, budget)
    return pick


@dataclass(frozen=True)
class DeepHKVD(CacheBlend):
    """CacheBlend HKVD with one selection, at layer `first` instead of 1: the layers before
    it run every reused token (the deviation check at a deeper layer, §4.3)."""

    first: int = 2

    def hkvd_share(self, layer: int, num_layers: int) -> float | None:
        return self.ratio if layer == self.first else None


def _selective_from(policy: ReusePolicy) -> int:
    """First layer on which a policy selects rows (layers before it run every reused token)."""
    if isinstance(policy, DeepHKVD):
        return policy.first
    return 1 if isinstance(policy, CacheBlend) else 0


def score(engine: LlamaEngine, ps: Sequence[Prompt], policy: ReusePolicy, pick: Pick = no_tokens) -> dict:
    """Exact match (by kind) and how much was computed.

    recomputed_share      reused token-layers recomputed, every layer (layer 0 included)
    recomputed_selective  the same on the layers where the policy selects (CacheBlend's r:
                          from layer 1 on for HKVD; every layer for a recompute list)
    prompt_computed       all prompt token-layers computed (fresh, question, recompute)
    """
    hits: dict[str, list[int]] = {}
    recomputed = selective = computed = 0.0
    for p in ps:
        lists = pick(p)
        segs = [Segment(c, cached=True, cached_prefix=p.stored[j].prefix, recompute=lists.get(j, ()))
                for j, c in enumerate(p.chunks)]
        segs.append(Segment(p.question, question=True))
        source = InMemoryLayerSource({j: v.kv for j, v in p.stored.items()})
        r = blend_prefill(engine, segs, policy, source, gate=TRUSTED)
        ok = int(int(r.logits.argmax()) == p.answer)
        for k in ("all", p.kind):
            hits.setdefault(k, []).append(ok)
        n = sum(map(len, p.chunks)) + len(p.question)
        if r.computed_rows:
            layers = range(_selective_from(policy), len(r.recomputed_rows))
            recomputed += r.recompute_ratio
            if r.reused_tokens:
                selective += sum(r.recomputed_rows[l] for l in layers) / (r.reused_tokens * len(layers))
            computed += sum(r.computed_rows) / (len(r.computed_rows) * n)
        else:
            computed += 1.0  # served by full prefill
    return {**{f"acc_{k}": sum(v) / len(v) for k, v in sorted(hits.items())},
            "recomputed_share": recomputed / len(ps), "recomputed_selective": selective / len(ps),
            "prompt_computed": computed / len(ps)}


def methods(full: bool = True) -> list[tuple[str, ReusePolicy, Pick]]:
    """Every selection measured, as (name, policy, per-prompt recompute lists)."""
    cc = Policy("cachecraft")
    rows: list[tuple[str, ReusePolicy, Pick]] = [("full prefill", Policy("full"), no_tokens),
                                            ("naive reuse", Policy("naive"), no_tokens)]
    for r in (0.05, 0.10, 0.15, 0.30):
        rows.append((f"cacheblend r={r:.0%}", Policy("cacheblend", ratio=r), no_tokens))
    for first in (2, 3):
        for r in (0.10, 0.15):
            rows.append((f"hkvd at layer {first} only, r={r:.0%}", DeepHKVD(ratio=r, first=first), no_tokens))
    for f in (0.15, 0.30, 0.50):
        rows.append((f"cachecraft top {f:.0%} by inter-attention (eq. 14)", cc, top_inter_attention(f)))
    for b in (0.05, 0.10, 0.15):
        rows.append((f"learned: fresh gain, prompt budget {b:.0%}", cc, learned(b, "gain")))
    rows.append(("learned: fresh gain, 1 token per chunk", cc, learned(0.1, "gain", spread="chunk")))
    rows.append((f"learned: default (greedy recompute gain, {DEFAULT_ROUNDS} rounds), prompt budget "
                 f"{DEFAULT_BUDGET:.0%}", cc, learned(DEFAULT_BUDGET, "default")))
    for k in (2, 3, 4, 6):
        for b in (0.05, 0.10, 0.15):
            rows.append((f"learned: greedy recompute gain, {k} rounds, prompt budget {b:.0%}", cc,
                         learned(b, "recompute gain", rounds=k)))
    for b in (0.10, 0.15):
        rows.append((f"learned: stale loss, prompt budget {b:.0%}", cc, learned(b, "loss")))
        rows.append((f"learned: fresh gain or stale loss, prompt budget {b:.0%}", cc, learned(b, "gain or loss")))
    for b in (0.05, 0.10, 0.15):
        rows.append((f"learned: read x deviation, prompt budget {b:.0%}", cc, learned(b)))
    rows.append(("learned: read x deviation, 1 token per chunk", cc, learned(0.1, spread="chunk")))
    for b in (0.10, 0.15):
        rows.append((f"learned: deviation, prompt budget {b:.0%}", cc, learned(b, "deviation")))
    for b in (0.10, 0.15):
        rows.append((f"learned: read, prompt budget {b:.0%}", cc, learned(b, "read")))
    for what in ORACLES:
        rows.append((f"oracle: {what}", cc, oracle(what)))
    if full:
        rows.append(("learned: deviation vs alone, prompt budget 15%", cc, learned(0.15, "deviation alone")))
        for name, pos in (("first token", (0,)), ("companion (2nd to last)", (-2,)), ("last", (-1,))):
            rows.append((f"fixed: {name}", cc, fixed(pos)))
    return rows


HEADER = (f"{'selection':<52} {'acc':>6} {'cross':>6} {'local':>6} {'reused/sel':>10} {'reused/all':>10} "
          f"{'prompt':>7}")


def row(name: str, r: dict) -> str:
    return (f"{name:<52} {r['acc_all']:>6.3f} {r.get('acc_cross', 0):>6.3f} {r.get('acc_local', 0):>6.3f} "
            f"{r['recomputed_selective']:>10.3f} {r['recomputed_share']:>10.3f} {r['prompt_computed']:>7.3f}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbench.quality.selection", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=300)
    ap.add_argument("--seed", type=int, default=3,
                    help="held-out draw (2: the validation draw methods were chosen on; 3: the report)")
    ap.add_argument("--task", choices=sorted(TASKS), default="short",
                    help="short: 6 chunks of 7-10 words; long: 5-8 chunks of 32-52 words (longdata)")
    ap.add_argument("--observe", type=int, default=2,
                    help="later requests that computed each chunk in full (learned lists learn from them)")
    ap.add_argument("--rounds", type=int, default=6, help="greedy rounds of the recompute gain (at most)")
    ap.add_argument("--model-dir", type=Path, default=None, help="default: the task's committed model")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", default="", help="measure only the methods whose name matches this regex")
    ap.add_argument("--save-lists", type=Path, help="also save the default learned lists (a test fixture)")
    a = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    engine = LlamaEngine.from_pretrained(a.model_dir or (MODEL_DIR if a.task == "short" else LONG_MODEL_DIR))
    chosen = [m for m in methods() if re.search(a.only, m[0])]
    # Compute only what the chosen methods read: eq. 14 needs the stored variants'
    # statistics, "vs alone" the chunks computed alone.
    ps = prompts(engine, a.examples, seed=a.seed, progress=True, observe=a.observe, task=a.task,
                 losses=any("stale loss" in m[0] for m in chosen),
                 recompute=a.rounds,
                 compare_alone=any("vs alone" in m[0] for m in chosen),
                 stats=any("eq. 14" in m[0] for m in chosen))
    if a.save_lists:
        save_lists(ps, a.save_lists)
    rows = []
    print(HEADER)
    for name, policy, pick in chosen:
        r = score(engine, ps, policy, pick)
        rows.append({"selection": name, **r})
        print(row(name, r), flush=True)
    if a.json:
        a.json.write_text(json.dumps({"examples": a.examples, "seed": a.seed, "task": a.task,
                                      "observe": a.observe, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
