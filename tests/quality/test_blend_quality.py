"""The trained model answers through the adapter's blended prefill, not only through
transformers: the reference engine, RoPE re-rotation of stored keys, selective
attention and CacheBlend's HKVD selection, on questions whose answers need
cross-chunk attention. A regression in any of them that costs answers fails here.

Every stored variant is computed behind one chunk of ANOTHER prompt (as a chunk
cache made by an earlier request), so a reused "they" chunk is bound to a stranger:
reusing it as is answers wrong, and blending must repair it.
"""

from __future__ import annotations

import pytest
import torch

from engine_adapter import LlamaEngine, Policy
from engine_adapter.blend import blend_prefill
from engine_adapter.probe import TRUSTED
from engine_adapter.prompt import Segment
from engine_adapter.source import InMemoryLayerSource
from kvbench.quality import data, modeling

N_EXAMPLES = 40  # a fixed held-out prefix: a few seconds on one CPU thread

pytestmark = pytest.mark.skipif(not (modeling.MODEL_DIR / "model.safetensors").exists(),
                                reason=f"no trained model committed under {modeling.MODEL_DIR}")


@pytest.fixture(scope="module")
def prompts():
    torch.set_num_threads(1)
    engine = LlamaEngine.from_pretrained(modeling.MODEL_DIR)
    tok = modeling.build_tokenizer()
    exs = data.examples("heldout", N_EXAMPLES + 1)
    enc = [modeling.encode(tok, e) for e in exs]
    out = []
    for i in range(N_EXAMPLES):
        chunks = [list(c) for c in enc[i].chunk_ids]
        strangers = [list(c) for c in enc[i + 1].chunk_ids]
        stored = {}
        for j, c in enumerate(chunks):
            behind = strangers[j - 1]  # the chunk before position j, of another prompt
            r = blend_prefill(engine, [Segment(behind), Segment(c)], Policy("full"), InMemoryLayerSource({}),
                              gate=TRUSTED)
            stored[j] = r.fresh[1]
        out.append((chunks, list(enc[i].question_ids), enc[i].answer_ids[0], stored))
    return engine, out


def accuracy(engine: LlamaEngine, prompts, policy: Policy) -> float:
    hits = 0
    for chunks, question, answer, stored in prompts:
        segs = [Segment(c, cached=True, cached_prefix=stored[j].prefix) for j, c in enumerate(chunks)]
        segs.append(Segment(question, question=True))
        source = InMemoryLayerSource({j: v.kv for j, v in stored.items()})
        r = blend_prefill(engine, segs, policy, source, gate=TRUSTED)
        hits += int(r.logits.argmax()) == answer
    return hits / len(prompts)


@pytest.fixture(scope="module")
def scores(prompts):
    engine, ps = prompts
    return {name: accuracy(engine, ps, policy) for name, policy in {
        "full": Policy("full"),
        "naive": Policy("naive"),
        "cacheblend": Policy("cacheblend", ratio=0.15),
    }.items()}


def test_reference_engine_answers_like_the_trained_model(scores):
    assert scores["full"] >= 0.9, scores


def test_reusing_chunk_caches_from_other_contexts_as_is_loses_answers(scores):
    assert scores["naive"] <= scores["full"] - 0.25, scores


def test_cacheblend_at_15_percent_recovers_most_answers(scores):
    assert scores["cacheblend"] >= scores["full"] - 0.10, scores
    assert scores["cacheblend"] >= scores["naive"] + 0.15, scores
