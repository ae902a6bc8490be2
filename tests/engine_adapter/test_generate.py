"""Greedy decoding after a prefill (full or blended) against transformers, on the trained quality model."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from .adapter_helpers import variant
from engine_adapter.blend import blend_prefill
from engine_adapter.generate import greedy, stop_tokens
from engine_adapter.llama import LlamaEngine
from engine_adapter.policy import Policy
from engine_adapter.probe import TRUSTED
from engine_adapter.prompt import Segment
from engine_adapter.source import InMemoryLayerSource
from kvbench.quality import data, modeling

pytestmark = pytest.mark.skipif(not (modeling.MODEL_DIR / "model.safetensors").exists(),
                                reason=f"no trained model committed under {modeling.MODEL_DIR}")


@pytest.fixture(scope="module")
def models():
    hf, tok = modeling.load()
    return LlamaEngine.from_pretrained(modeling.MODEL_DIR), hf, tok


@pytest.fixture(scope="module")
def prompts(models):
    return [modeling.encode(models[2], ex) for ex in data.examples("heldout", 6)]


def _hf_decode(hf, kv, first: int, max_new: int, stop: frozenset[int]) -> list[int]:
    """transformers' forward, one token at a time over a cache injected from `kv`."""
    cache = DynamicCache()
    for layer, (k, v) in enumerate(kv):
        cache.update(k[None].clone(), v[None].clone(), layer)  # [1, Hkv, N, D]
    out, pos = [first], kv[0][0].shape[1]
    with torch.no_grad():
        while len(out) < max_new and out[-1] not in stop:
            logits = hf(torch.tensor([out[-1:]]), position_ids=torch.tensor([[pos]]), past_key_values=cache,
                        use_cache=True).logits
            out.append(int(logits[0, -1].argmax()))
            pos += 1
    return out


def test_greedy_after_full_prefill_matches_transformers_generate(models, prompts):
    engine, hf, _ = models
    stop = stop_tokens(modeling.MODEL_DIR)
    ended = 0
    for p in prompts:
        ids = torch.tensor([p.prompt_ids])
        ref = hf.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
        logits, kv = engine.prefill(ids[0], all_logits=False)
        got = greedy(engine, logits, kv, 8, stop)
        assert list(got.tokens) == ref
        ended += got.stopped
    assert ended == len(prompts)  # the trained model answers a name then <eos>


def test_without_stop_tokens_it_decodes_max_new_tokens_as_transformers_does(models, prompts):
    # transformers' generate always adds the model's eos, so its forward decodes here instead
    engine, hf, _ = models
    logits, kv = engine.prefill(torch.tensor(prompts[0].prompt_ids), all_logits=False)
    got = greedy(engine, logits, kv, 12)
    assert len(got.tokens) == 12 and not got.stopped
    assert list(got.tokens) == _hf_decode(hf, kv, got.tokens[0], 12, frozenset())


def test_greedy_continues_a_blended_cache_as_transformers_does_over_the_same_cache(models, prompts):
    engine, hf, _ = models
    stop = stop_tokens(modeling.MODEL_DIR)
    p = prompts[1]
    cache = {i: variant(engine, [list(prompts[2].chunk_ids[i % 3])], list(c)) for i, c in enumerate(p.chunk_ids)}
    segs = [Segment(c, cached=True, cached_prefix=cache[i].prefix) for i, c in enumerate(p.chunk_ids)]
    segs.append(Segment(p.question_ids, question=True))
    source = InMemoryLayerSource({i: v.kv for i, v in cache.items()})
    r = blend_prefill(engine, segs, Policy("cacheblend", ratio=0.15), source, gate=TRUSTED)
    assert r.reuse and r.computed_share < 1.0
    got = greedy(engine, r.logits, r.kv, 10, stop)
    assert list(got.tokens) == _hf_decode(hf, r.kv, got.tokens[0], 10, stop)


def test_full_policy_blend_then_greedy_equals_prefill_then_greedy(models, prompts):
    engine, _, _ = models
    p = prompts[3]
    segs = [Segment(c) for c in p.chunk_ids] + [Segment(p.question_ids, question=True)]
    r = blend_prefill(engine, segs, Policy("full"), InMemoryLayerSource({}), gate=TRUSTED)
    logits, kv = engine.prefill(torch.tensor(p.prompt_ids), all_logits=False)
    assert greedy(engine, r.logits, r.kv, 6).tokens == greedy(engine, logits, kv, 6).tokens


def test_teacher_forcing_predicts_what_transformers_predicts_over_the_fed_tokens(models, prompts):
    # fed tokens that are not the model's own: each pick is transformers' argmax after the
    # prompt and the tokens fed before it (one forward over all of them, causal)
    engine, hf, _ = models
    p = prompts[4]
    feed = [int(t) for t in torch.randint(0, engine.cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(4))]
    logits, kv = engine.prefill(torch.tensor(p.prompt_ids), all_logits=False)
    got = greedy(engine, logits, kv, 16, feed=feed)
    with torch.no_grad():
        ref = hf(torch.tensor([p.prompt_ids + feed[:-1]])).logits[0, len(p.prompt_ids) - 1:].argmax(-1).tolist()
    assert len(got.tokens) == len(feed) and list(got.tokens) == ref
    assert greedy(engine, logits, kv, 4, feed=feed).tokens == got.tokens[:4]  # at most max_new_tokens


def test_greedy_leaves_the_prefill_cache_untouched(models, prompts):
    engine = models[0]
    logits, kv = engine.prefill(torch.tensor(prompts[0].prompt_ids), all_logits=False)
    before = [(k.clone(), v.clone()) for k, v in kv]
    greedy(engine, logits, kv, 5)
    assert all(torch.equal(k, bk) and torch.equal(v, bv) for (k, v), (bk, bv) in zip(kv, before))


def test_stop_tokens_come_from_generation_config_else_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert stop_tokens(tmp_path) == {7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    assert stop_tokens(tmp_path) == {2, 5}
    assert stop_tokens(tmp_path / "absent") == frozenset()
