"""The committed quality model answers held-out questions, and naive reuse hurts it.

Loads bench/quality/model/ with transformers only. If the weights were retrained
badly, or the task stopped needing cross-chunk attention, these tests fail.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvbench.quality import data, modeling, naive_check

N_EXAMPLES = 60  # fixed held-out prefix: deterministic and a few seconds on one CPU thread


HAVE_MODEL = (modeling.MODEL_DIR / "model.safetensors").exists()
# Weights are committed only once a training run reaches the 90% bar (docs/quality.md).
pytestmark = pytest.mark.skipif(not HAVE_MODEL, reason=f"no trained model committed under {modeling.MODEL_DIR}")


@pytest.fixture(scope="module")
def model_and_tok():
    torch.set_num_threads(1)
    return modeling.load()


@pytest.fixture(scope="module")
def accuracy(model_and_tok):
    model, tok = model_and_tok
    return naive_check.evaluate(model, tok, data.examples("heldout", N_EXAMPLES))


def test_weights_are_small_llama_under_20_mb():
    size = (modeling.MODEL_DIR / "model.safetensors").stat().st_size
    assert size < 20 * 2**20
    cfg = modeling.LlamaConfig.from_pretrained(str(modeling.MODEL_DIR))
    assert cfg.model_type == "llama"
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA, like the models served


def test_full_prefill_exact_match_is_at_least_90_percent(accuracy):
    assert accuracy["full"]["all"] >= 0.90, accuracy


def test_naive_reuse_is_measurably_worse_than_full_prefill(accuracy):
    assert accuracy["naive"]["all"] <= accuracy["full"]["all"] - 0.25, accuracy


def test_naive_reuse_fails_cross_chunk_questions_not_local_ones(accuracy):
    # Local questions need one chunk and survive naive reuse; questions whose
    # city sits in a "they" chunk lose the link to the name in the chunk before.
    assert accuracy["naive"]["cross"] < 0.5 * accuracy["full"]["cross"], accuracy
    assert accuracy["naive"]["local"] > accuracy["naive"]["cross"], accuracy


def test_injected_full_prefill_cache_matches_plain_forward(model_and_tok):
    # The cache path used by the naive check reproduces an ordinary forward pass,
    # so any gap between modes comes from what the chunk KV saw, not plumbing.
    model, tok = model_and_tok
    ex = data.examples("heldout", 1)[0]
    enc = modeling.encode(tok, ex)
    chunks = [list(c) for c in enc.chunk_ids]
    cache, start = naive_check.full_prefill_cache(model, chunks)
    q = torch.tensor([list(enc.question_ids)])
    with torch.no_grad():
        via_cache = model(input_ids=q, position_ids=torch.arange(start, start + q.shape[1])[None],
                          past_key_values=cache).logits[0, -1]
        plain = model(input_ids=torch.tensor([enc.prompt_ids])).logits[0, -1]
    torch.testing.assert_close(via_cache, plain, atol=1e-4, rtol=1e-4)


def test_rope_shift_equals_recompute_at_shifted_positions(model_and_tok):
    # A chunk computed at positions 0.. and re-rotated by s has the keys of the same
    # chunk computed alone at positions s.. (values do not depend on position).
    model, tok = model_and_tok
    ids = list(modeling.encode(tok, data.examples("heldout", 1)[0]).chunk_ids[1])
    at0 = naive_check.chunk_cache_alone(model, ids)
    s = 37
    with torch.no_grad():
        shifted = DynamicCache()
        model(input_ids=torch.tensor([ids]), position_ids=torch.arange(s, s + len(ids))[None],
              past_key_values=shifted, use_cache=True)
    # Attention scores are invariant to a common shift, so every layer's hidden
    # states match and every layer's keys differ by exactly the extra rotation.
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(naive_check.rope_shift(at0.layers[layer].keys, s, model),
                                   shifted.layers[layer].keys, atol=1e-4, rtol=1e-4)
