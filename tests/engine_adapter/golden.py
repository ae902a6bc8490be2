"""Golden outputs of every reuse policy on two real models, over fixed prompts.

The blended prefill's loop can be rewritten (one layer step, policies as plug-ins, static
steps) without changing what any policy computes. These cases pin what it computed before
(`golden-*.json`, written by `python -m tests.engine_adapter.golden record`, recorded once on
the loop the one-layer step replaced, on one thread: a matmul's sums are ordered by its threads): every policy's last-position logits (top 16 and the
whole vector's sum and norm), four greedy tokens decoded over the cache the prefill returned
(what the merged cache holds), the rows computed per layer, the chunks that stayed reused or
fell back, and the statistics of the chunks computed fresh (the variants a request stores).

Models: the quality model trained here on the synthetic task (bench/quality/model, 4 layers)
and SmolLM2-135M-Instruct (30 layers, `kvcraft model fetch`) on MuSiQue passages. Each
prompt's passages are stored behind another record's passage (the RAG case: moved chunks);
the instruction behind nothing, as every request sends it (exact, reusable by `prefix`).
Cases: every policy as the configuration names it, options that take other paths (Cache-Craft's
Alg. 1, CacheBlend by ratio, the default's signals alone), a chunk computed fresh, and a
chunk whose layer 2 never arrives (the catch-up).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from engine_adapter.blend import blend_prefill
from engine_adapter.generate import greedy
from engine_adapter.llama import LlamaEngine
from engine_adapter.policy import parse_policy
from engine_adapter.probe import TRUSTED
from engine_adapter.prompt import Segment
from engine_adapter.source import InMemoryLayerSource

HERE = Path(__file__).parent
TOP = 16  # logits kept per case, with their token ids
DECODED = 4  # greedy tokens over the returned cache

# (case name, policy spec, how the prompt is served: "stored" every passage reused, "fresh"
# the last passage has no stored variant, "late" passage 1's layer 2 never arrives)
CASES: dict[str, list[tuple[str, str, str]]] = {
    "quality": [
        ("full", "full", "stored"),
        ("prefix", "prefix", "stored"),
        ("naive", "naive", "stored"),
        ("cachecraft", "cachecraft", "stored"),
        ("cachecraft-focus", "cachecraft:focus_window=1", "stored"),
        ("cacheblend-ratio", "cacheblend:ratio=0.3", "stored"),
        ("cacheblend-budget", "cacheblend:budget=0.5", "stored"),
        ("default", "query", "stored"),
        ("default-budget", "query:budget=0.5", "stored"),
        ("default-reads", "query:budget=0.5,deviation=0", "stored"),
        ("default-single", "query:budget=0.5,heads=0", "stored"),
        ("naive-fresh", "naive", "fresh"),
        ("cacheblend-fresh", "cacheblend:ratio=0.3", "fresh"),
        ("default-fresh", "query:budget=0.5", "fresh"),
        ("naive-late", "naive", "late"),
        ("default-late", "query:budget=0.5", "late"),
    ],
    "smollm2": [
        ("full", "full", "stored"),
        ("prefix", "prefix", "stored"),
        ("naive", "naive", "stored"),
        ("cachecraft", "cachecraft", "stored"),
        ("cachecraft-focus", "cachecraft:focus_window=2", "stored"),
        ("cacheblend", "cacheblend", "stored"),
        ("default", "query", "stored"),
        ("default-reads", "query:deviation=0", "stored"),
        ("default-fresh", "query", "fresh"),
        ("cacheblend-late", "cacheblend", "late"),
        ("default-late", "query", "late"),
    ],
}
RECOMPUTE_SHARE = 0.15  # Cache-Craft's lists: each passage's top tokens by eq. 14's inter-attention


def quality_prompts() -> tuple[LlamaEngine, list[tuple[list[tuple[int, ...]], tuple[int, ...], tuple[int, ...]]]]:
    """The quality model and two held-out synthetic prompts: (chunks, question, a stranger chunk
    each chunk's variant was computed behind)."""
    from kvbench.quality import data
    from kvbench.quality.modeling import MODEL_DIR, build_tokenizer, encode

    engine = LlamaEngine.from_pretrained(MODEL_DIR)
    tok = build_tokenizer()
    exs = data.examples("heldout", 3, seed=7)
    out = []
    for ex, other in zip(exs[:2], exs[1:]):
        enc, stranger = encode(tok, ex), encode(tok, other)
        out.append((list(enc.chunk_ids), enc.question_ids, stranger.chunk_ids[0]))
    return engine, out


def smollm2_prompts(model_dir: Path) -> tuple[LlamaEngine, list]:
    """SmolLM2-135M and two MuSiQue records of two passages, the instruction first."""
    from transformers import AutoTokenizer

    from kvbench.common import musique

    engine = LlamaEngine.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    recs = musique.load(passages=2, limit=3)
    out = []
    for rec, other in zip(recs[:2], recs[1:]):
        p, q = musique.prompt(tok, rec), musique.prompt(tok, other)
        out.append(([p.instruction, *p.passages], p.question, q.passages[0]))
    return engine, out


def _variant(engine: LlamaEngine, prefix: list[tuple[int, ...]], chunk: tuple[int, ...]):
    segs = [Segment(c) for c in prefix] + [Segment(chunk)]
    return blend_prefill(engine, segs, parse_policy("full"), InMemoryLayerSource({}), gate=TRUSTED).fresh[len(prefix)]


def _floats(x: torch.Tensor) -> list[float]:
    return [float(v) for v in x.flatten().tolist()]


def stored_variants(engine: LlamaEngine, chunks: list[tuple[int, ...]], stranger: tuple[int, ...]) -> dict:
    """Chunk index -> its stored variant: the first (the instruction) behind nothing, as every
    request sends it; the others behind `stranger`."""
    stored = {0: _variant(engine, [], chunks[0])}
    for i in range(1, len(chunks)):
        stored[i] = _variant(engine, [stranger], chunks[i])
    return stored


def run_case(engine: LlamaEngine, chunks: list[tuple[int, ...]], question: tuple[int, ...], stored: dict,
             spec: str, serve: str) -> dict[str, Any]:
    """One case's outputs as JSON-ready values (floats exact: fp32 as Python floats)."""
    stored = dict(stored)
    if serve == "fresh":
        del stored[len(chunks) - 1]
    segments = []
    for i, c in enumerate(chunks):
        if i not in stored:
            segments.append(Segment(c))
            continue
        tia = torch.tensor(stored[i].stats.token_inter_attention)
        n = round(RECOMPUTE_SHARE * len(c)) if i else 0
        top = tia.topk(n).indices.tolist() if n else []
        segments.append(Segment(c, cached=True, cached_prefix=stored[i].prefix, recompute=top))
    segments.append(Segment(question, question=True))
    withhold = [(1, 2)] if serve == "late" else []
    source = InMemoryLayerSource({i: v.kv for i, v in stored.items()}, withhold=withhold)
    res = blend_prefill(engine, segments, parse_policy(spec), source, gate=TRUSTED)
    top = res.logits.topk(TOP)
    gen = greedy(engine, res.logits, res.kv, DECODED)
    fresh = {}
    for s, f in sorted(res.fresh.items()):
        st = f.stats
        fresh[str(s)] = {"a": st.a, "b": st.b, "prefix_attention": list(st.prefix_attention),
                         "token_inter_attention": list(st.token_inter_attention),
                         "kv_sum": [float(sum(k.double().sum() for k, _ in f.kv)),
                                    float(sum(v.double().sum() for _, v in f.kv))]}
    return {
        "top_ids": top.indices.tolist(), "top_logits": _floats(top.values),
        "logits_sum": float(res.logits.double().sum()), "logits_norm": float(res.logits.double().norm()),
        "decoded": list(gen.tokens), "computed_rows": list(res.computed_rows),
        "reused_segments": list(res.reused_segments), "fallbacks": [list(f) for f in res.fallbacks],
        "fresh": fresh,
    }


def run_model(model: str, model_dir: Path | None = None, prompts: int | None = None,
              cases: set[str] | None = None) -> dict[str, dict[str, Any]]:
    """Every case of `model` (those named in `cases`) on each of its prompts (the first `prompts`
    of them): {"<prompt>/<case>": outputs}."""
    engine, prompts_ = quality_prompts() if model == "quality" else smollm2_prompts(model_dir)
    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a matmul's sums are ordered by its threads: one, wherever it runs
    try:
        with torch.no_grad():
            for i, (chunks, question, stranger) in enumerate(prompts_[:prompts]):
                stored = stored_variants(engine, chunks, stranger)
                for name, spec, serve in CASES[model]:
                    if cases is None or name in cases:
                        out[f"{i}/{name}"] = run_case(engine, chunks, question, stored, spec, serve)
    finally:
        torch.set_num_threads(threads)
    return out


def path(model: str) -> Path:
    return HERE / f"golden-{model}.json"


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "record" or argv[1] not in CASES:
        print("usage: python -m tests.engine_adapter.golden record quality|smollm2 [MODEL_DIR]", file=sys.stderr)
        return 2
    model = argv[1]
    got = run_model(model, Path(argv[2]) if len(argv) > 2 else None)
    path(model).write_text(json.dumps(got, indent=1) + "\n")
    print(f"wrote {len(got)} cases to {path(model)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
