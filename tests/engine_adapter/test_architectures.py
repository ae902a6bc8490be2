"""The architectures the reference engine blends (`llama.ARCHITECTURES`): Llama (with q/k/v/o
biases and with Llama 3's RoPE scaling), Mistral, Qwen2 (q/k/v biases), Qwen3 (q and k heads
normalized before RoPE), each a tiny model with random weights made by transformers' own
config and model classes (no hub): the engine's full prefill against transformers', stored K
re-rotated to another place against K computed there, and blends against full prefill."""

from __future__ import annotations

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from engine_adapter.blend import blend_prefill
from engine_adapter.llama import LlamaEngine, rope_for_spec
from engine_adapter.policy import Policy
from engine_adapter.probe import TRUSTED, probe
from kvkernels import apply_rope
from tests.engine_adapter.adapter_helpers import make_prompt, rel_dev

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}
MODELS = {
    "llama-biases": (LlamaConfig, LlamaForCausalLM, {"attention_bias": True}),
    "llama3-rope": (LlamaConfig, LlamaForCausalLM, {"rope_parameters": LLAMA3_ROPE}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request, tmp_path_factory):
    """(transformers' model, the engine loaded from its saved folder)."""
    config, model, extra = MODELS[request.param]
    torch.manual_seed(0)
    hf = model(config(**SMALL, **extra)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "bias" in name or "norm" in name:  # not the initial zeros and ones: their use must show
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
            elif "weight" in name:
                p.normal_(0.0, 0.1)  # peaked enough for context to matter
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, LlamaEngine.from_pretrained(path)


def test_full_prefill_matches_transformers(pair):
    hf, engine = pair
    tokens = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens[None]).logits[0]
    logits, kv = engine.prefill(tokens)
    assert (logits - ref).abs().max() < 1e-4
    assert len(kv) == SMALL["num_hidden_layers"]


def test_stored_k_rotated_to_another_place_is_k_computed_there(pair):
    """A chunk's K computed alone (positions 0..T-1) and stored RoPE-free, rotated to positions
    s..s+T-1, is the K of the same chunk computed at s: exact for each RoPE variant (q/k norms
    and biases act before RoPE, on the token alone)."""
    _, engine = pair
    chunk = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(2))
    rope = rope_for_spec(engine.model_spec())
    _, alone = engine.prefill(chunk)
    for start in (5, 300):
        _, there = engine.prefill(chunk, start_pos=start)
        for (k0, _), (k, _) in zip(alone, there):
            stored = apply_rope(k0, torch.arange(12), rope, inverse=True)
            torch.testing.assert_close(apply_rope(stored, torch.arange(start, start + 12), rope), k,
                                       atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("policy", ["naive", "cachecraft", "cacheblend", "query", "epic"])
def test_exact_stored_kv_blends_to_full_prefill_under_every_policy(pair, policy):
    _, engine = pair
    assert probe(engine).ok  # the reuse gate's own check: a moved chunk, every token recomputed
    p = make_prompt(engine, seed=3, behind="same", chunk_len=16)
    options = {"ratio": 0.3} if policy == "cacheblend" else {}
    r = blend_prefill(engine, p.segments(), Policy(policy, **options), p.source(), gate=TRUSTED)
    assert r.reuse and rel_dev(r.logits, engine.prefill(p.tokens)[0][-1]) < 1e-5


def test_moved_chunks_recomputed_in_full_are_full_prefill_and_naive_reuse_is_not(pair):
    _, engine = pair
    p = make_prompt(engine, seed=4, behind="other", chunk_len=16)
    full = engine.prefill(p.tokens)[0][-1]
    every = blend_prefill(engine, p.segments(recompute=1.0), Policy("cachecraft"), p.source(), gate=TRUSTED)
    naive = blend_prefill(engine, p.segments(), Policy("naive"), p.source(), gate=TRUSTED)
    assert rel_dev(every.logits, full) < 1e-5
    assert rel_dev(naive.logits, full) > 1e-3
