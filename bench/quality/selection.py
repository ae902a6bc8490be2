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
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from rich.progress import track

from engine_adapter import LlamaEngine, Policy
from engine_adapter.blend import FreshChunk, blend_prefill
from engine_adapter.probe import TRUSTED
from engine_adapter.prompt import Segment
from engine_adapter.source import InMemoryLayerSource
from kvbench.quality import data
from kvbench.quality.modeling import MODEL_DIR, build_tokenizer, encode


@dataclass(frozen=True)
class Prompt:
    chunks: list[list[int]]
    question: list[int]
    answer: int  # first answer token (answers are one word)
    kind: str
    stored: dict[int, FreshChunk]  # chunk index -> its variant, computed behind a stranger


def prompts(engine: LlamaEngine, n: int, seed: int = 1, progress: bool = False) -> list[Prompt]:
    """`n` held-out prompts with their chunks' variants computed behind another prompt's chunk."""
    tok = build_tokenizer()
    exs = data.examples("heldout", n + 1, seed=seed)
    enc = [encode(tok, e) for e in exs]
    out = []
    for i in (track(range(n), description="variants") if progress else range(n)):
        chunks = [list(c) for c in enc[i].chunk_ids]
        strangers = [list(c) for c in enc[i + 1].chunk_ids]
        stored = {}
        for j, c in enumerate(chunks):
            behind = strangers[j - 1]  # the chunk before position j, of another prompt
            r = blend_prefill(engine, [Segment(behind), Segment(c)], Policy("full"), InMemoryLayerSource({}),
                              gate=TRUSTED)
            stored[j] = r.fresh[1]
        out.append(Prompt(chunks, list(enc[i].question_ids), enc[i].answer_ids[0], exs[i].kind, stored))
    return out


def top_inter_attention(p: Prompt, j: int, fraction: float) -> list[int]:
    """Cache-Craft eq. 14: the ceil(fraction |C_j|) tokens with the most attention to prior chunks."""
    tia = torch.tensor(p.stored[j].stats.token_inter_attention)
    n = math.ceil(fraction * len(p.chunks[j]))
    return tia.topk(n).indices.tolist() if n else []


def score(engine: LlamaEngine, ps: Sequence[Prompt], policy: Policy,
          recompute=lambda p, j: ()) -> dict:
    """Exact match (by kind) and the share of reused token-layers recomputed.

    recompute(prompt, chunk index) -> token indices: the per-chunk lists of `cachecraft`."""
    hits: dict[str, list[int]] = {}
    recomputed = 0.0
    for p in ps:
        segs = [Segment(c, cached=True, cached_prefix=p.stored[j].prefix, recompute=recompute(p, j))
                for j, c in enumerate(p.chunks)]
        segs.append(Segment(p.question, question=True))
        source = InMemoryLayerSource({j: v.kv for j, v in p.stored.items()})
        r = blend_prefill(engine, segs, policy, source, gate=TRUSTED)
        ok = int(int(r.logits.argmax()) == p.answer)
        for k in ("all", p.kind):
            hits.setdefault(k, []).append(ok)
        recomputed += r.recompute_ratio
    return {**{f"acc_{k}": sum(v) / len(v) for k, v in sorted(hits.items())},
            "recomputed_share": recomputed / len(ps)}


def fixed(positions: Sequence[int]):
    """The same token positions in every chunk (negative = from the chunk's end)."""
    return lambda p, j: sorted({i % len(p.chunks[j]) for i in positions})


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbench.quality.selection", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=300)
    ap.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    engine = LlamaEngine.from_pretrained(a.model_dir)
    ps = prompts(engine, a.examples, progress=True)
    rows: list[tuple[str, dict]] = [("full prefill", score(engine, ps, Policy("full"))),
                                    ("naive reuse", score(engine, ps, Policy("naive")))]
    for r in (0.05, 0.10, 0.15, 0.30):
        rows.append((f"cacheblend r={r:.0%}", score(engine, ps, Policy("cacheblend", ratio=r))))
    for f in (0.15, 0.30, 0.50):
        rows.append((f"cachecraft top {f:.0%} by inter-attention (eq. 14)",
                     score(engine, ps, Policy("cachecraft"), lambda p, j, f=f: top_inter_attention(p, j, f))))
    for name, pos in (("first token", (0,)), ("4th (the city in 'they' chunks)", (3,)), ("first four", (0, 1, 2, 3)),
                      ("companion (2nd to last)", (-2,)), ("last", (-1,))):
        rows.append((f"fixed: {name}", score(engine, ps, Policy("cachecraft"), fixed(pos))))
    print(f"{'selection':<46} {'acc':>6} {'cross':>6} {'local':>6} {'recomputed':>11}")
    for name, r in rows:
        print(f"{name:<46} {r['acc_all']:>6.3f} {r.get('acc_cross', 0):>6.3f} {r.get('acc_local', 0):>6.3f} "
              f"{r['recomputed_share']:>11.3f}")
    if a.json:
        a.json.write_text(json.dumps([{"selection": n, **r} for n, r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
