"""Which tokens must be recomputed? Accuracy of blended prefill by token selection, in-process.

    kvcraft bench selection --examples 300 --seed 3
    kvcraft bench selection --examples 300 --seed 1 --only default --save-lists tests/quality/lists-seed1.pt

Every chunk's stored variant is computed behind one chunk of ANOTHER prompt (as an
earlier request would have left it), so a reused "they" chunk is bound to a stranger.
Then each prompt is prefilled through the adapter's blend (`blend_prefill`: RoPE
re-rotation, selective attention, HKVD) under:
  - the policies: full, naive, CacheBlend at r = 15% and 30%, Cache-Craft's top 15% of each
    chunk by inter-attention (eq. 14);
  - learned per-variant lists (`engine_adapter.learned`), learned from later requests that
    computed the chunk in full: by fresh gain, and the default (greedy recompute gain), at
    one prompt-wide budget of 15%;
  - fixed token sets (`fixed`: the same positions in every chunk; `fixed([-2])` = the
    companion named at the chunk's end), for the tests.
No service and no planner: this isolates token selection from everything else
(`kvbench.quality.evaluate` runs the same model through the real service).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from engine_adapter import LlamaEngine, Policy
from engine_adapter.blend import blend_prefill
from engine_adapter.learned import DEFAULT_ROUNDS
from engine_adapter.policy import CacheBlend, ReusePolicy
from engine_adapter.probe import TRUSTED
from engine_adapter.prompt import Segment
from engine_adapter.source import InMemoryLayerSource
from kvbench import results
from kvbench.common.args import count
from kvbench.quality.modeling import LONG_MODEL_DIR, MODEL_DIR
# the prompts: re-exported, `selection.prompts` / `selection.load_lists` stay where they were
from kvbench.quality.selection_prompts import TASKS, Prompt, load_lists, prompts, save_lists  # noqa: F401
from kvcraft.recompute import DEFAULT_BUDGET, allocate, per_chunk

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


def learned(budget: float, score: str = "default") -> Pick:
    """A learned per-variant list (`engine_adapter.learned`), learned from the later requests
    that computed the chunk in full (`prompts(observe=k)`) or loaded (`load_lists`):

      "default"  what store-back learns (`learned.learn`): the greedy recompute gain
      "gain"     the answer's loss from the token's stale KV (`fresh_gain`), merged

    The budget goes to the top scores of the whole prompt (`kvcraft.recompute.allocate`)."""
    if score not in ("default", "gain"):
        raise ValueError(f"unknown score {score!r}")

    def pick(p: Prompt) -> Mapping[int, Sequence[int]]:
        lists = p.lists if score == "default" else p.gains
        return allocate({j: lists[j].tolist() for j in p.stored}, budget)
    return pick


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
            layers = range(1 if isinstance(policy, CacheBlend) else 0, len(r.recomputed_rows))
            recomputed += r.recompute_ratio
            if r.reused_tokens:
                selective += sum(r.recomputed_rows[l] for l in layers) / (r.reused_tokens * len(layers))
            computed += sum(r.computed_rows) / (len(r.computed_rows) * n)
        else:
            computed += 1.0  # served by full prefill
    return {**{f"acc_{k}": sum(v) / len(v) for k, v in sorted(hits.items())},
            "recomputed_share": recomputed / len(ps), "recomputed_selective": selective / len(ps),
            "prompt_computed": computed / len(ps)}


def methods() -> list[tuple[str, ReusePolicy, Pick]]:
    """The selections measured, as (name, policy, per-prompt recompute lists)."""
    cc = Policy("cachecraft")
    return [("full prefill", Policy("full"), no_tokens),
            ("naive reuse", Policy("naive"), no_tokens),
            ("cacheblend r=15%", Policy("cacheblend", ratio=0.15), no_tokens),
            ("cacheblend r=30%", Policy("cacheblend", ratio=0.30), no_tokens),
            ("cachecraft top 15% by inter-attention (eq. 14)", cc, top_inter_attention(0.15)),
            (f"learned: fresh gain, prompt budget {DEFAULT_BUDGET:.0%}", cc, learned(DEFAULT_BUDGET, "gain")),
            (f"learned: default (greedy recompute gain, {DEFAULT_ROUNDS} rounds), prompt budget "
             f"{DEFAULT_BUDGET:.0%}", cc, learned(DEFAULT_BUDGET, "default"))]


HEADER = (f"{'selection':<52} {'acc':>6} {'cross':>6} {'local':>6} {'reused/sel':>10} {'reused/all':>10} "
          f"{'prompt':>7}")


def row(name: str, r: dict) -> str:
    return (f"{name:<52} {r['acc_all']:>6.3f} {r.get('acc_cross', 0):>6.3f} {r.get('acc_local', 0):>6.3f} "
            f"{r['recomputed_selective']:>10.3f} {r['recomputed_share']:>10.3f} {r['prompt_computed']:>7.3f}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    ap = argparse.ArgumentParser(prog="kvcraft bench selection", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=count(), default=300)
    ap.add_argument("--seed", type=count(0), default=3,
                    help="held-out draw (2 and 4: the validation draws methods were chosen on; 1 and 3: reports)")
    ap.add_argument("--task", choices=sorted(TASKS), default="short",
                    help="short: 6 chunks of 7-10 words; long: 5-8 chunks of 32-52 words (longdata)")
    ap.add_argument("--observe", type=count(0), default=2,
                    help="later requests that computed each chunk in full (learned lists learn from them)")
    ap.add_argument("--model-dir", type=Path, default=None, help="default: the task's committed model")
    results.add_argument(ap, "selection")
    ap.add_argument("--only", default="", help="measure only the methods whose name matches this regex")
    ap.add_argument("--save-lists", type=Path, help="also save the default learned lists (a test fixture)")
    a = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    engine = LlamaEngine.from_pretrained(a.model_dir or (MODEL_DIR if a.task == "short" else LONG_MODEL_DIR))
    chosen = [m for m in methods() if re.search(a.only, m[0])]
    # eq. 14 reads the stored variants' statistics: computed only when it is measured
    ps = prompts(engine, a.examples, seed=a.seed, progress=True, observe=a.observe, task=a.task,
                 stats=any("eq. 14" in m[0] for m in chosen))
    if a.save_lists:
        save_lists(ps, a.save_lists)
    rows = []
    print(HEADER)
    for name, policy, pick in chosen:
        r = score(engine, ps, policy, pick)
        rows.append({"selection": name, **r})
        print(row(name, r), flush=True)
    results.save("selection", argv, {"examples": a.examples, "seed": a.seed, "task": a.task, "observe": a.observe,
                                     "rows": rows}, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
