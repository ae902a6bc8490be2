"""What a full computation of a chunk shows (engine_adapter.observe) against independent
references: transformers' attention, the engine's own prefill, a loop."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from engine_adapter import observe as obs
from engine_adapter.llama import LlamaEngine
from kvkernels import apply_rope


def _kv(layers: int, t: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, t, 4, generator=g), torch.randn(2, t, 4, generator=g)) for _ in range(layers)]


def test_deviation_is_zero_for_identical_kv_and_finds_the_moved_token():
    kv = _kv(3, 6, 0)
    assert obs.kv_deviation(kv, kv).abs().max() == 0
    moved = [(k.clone(), v.clone()) for k, v in kv]
    moved[2][1][:, 4] += 5.0  # token 4's V on the last layer
    dev = obs.kv_deviation(kv, moved)
    assert int(dev.argmax()) == 4 and (dev[[0, 1, 2, 3, 5]] == 0).all()


def test_deviation_skips_layer_zero_by_default_and_matches_a_loop():
    a, b = _kv(3, 5, 1), _kv(3, 5, 2)
    want = torch.zeros(5)
    for layer in (1, 2):
        (ka, va), (kb, vb) = a[layer], b[layer]
        for t in range(5):
            d = sum(float((kb[h, t] - ka[h, t]).norm() + (vb[h, t] - va[h, t]).norm()) for h in range(2))
            scale = sum(float(ka[h, u].norm() + va[h, u].norm()) for h in range(2) for u in range(5)) / 5
            want[t] += d / scale
    assert torch.allclose(obs.kv_deviation(a, b), want, atol=1e-5)
    assert torch.allclose(obs.kv_deviation(a, b, [0]), obs.kv_deviation(a, b, [0]))
    with pytest.raises(ValueError, match="layer 1"):
        obs.kv_deviation(a, [a[0], (torch.zeros(2, 4, 4), torch.zeros(2, 4, 4)), a[2]])


def test_observe_matches_transformers_attention_and_the_engine_kv(tmp_path):
    LlamaEngine.random("tiny", seed=3, std=0.1).save_pretrained(tmp_path)
    engine = LlamaEngine.from_pretrained(tmp_path)
    hf = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tokens = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        att = hf(tokens[None], output_attentions=True).attentions  # per layer [1, Hq, T, T]
    want = sum(a[0, :, 18:24, 6:14].mean(0).sum(0) for a in att[1:])
    seen = obs.observe(engine, tokens.tolist(), (6, 14), (18, 24))
    assert torch.allclose(seen.received, want, atol=1e-5)
    only_last = obs.observe(engine, tokens.tolist(), (6, 14), (18, 24), layers=[-1]).received
    assert torch.allclose(only_last, att[-1][0, :, 18:24, 6:14].mean(0).sum(0), atol=1e-5)
    # The chunk's KV as the blend stores a fresh chunk (K without RoPE): un-rotate the
    # engine's own full-prefill K at the chunk's positions and compare.
    _, kv = engine.prefill(tokens)
    for layer, (k, v) in enumerate(seen.kv):
        k_full = apply_rope(kv[layer][0][:, 6:14], torch.arange(6, 14), engine.rope, inverse=True)
        assert torch.allclose(k, k_full, atol=1e-4) and torch.allclose(v, kv[layer][1][:, 6:14], atol=1e-5)


def test_learned_scores_need_both_a_move_and_a_reader():
    stored = _kv(2, 4, 0)
    moved = [(k.clone(), v.clone()) for k, v in stored]
    moved[1][0][:, 0] += 3.0  # token 0 moved but nobody reads it
    moved[1][0][:, 2] += 1.0  # token 2 moved and is read
    seen = obs.Observation(moved, torch.tensor([0.0, 1.0, 1.0, 0.0]))
    s = obs.learned_scores(stored, seen)
    assert int(s.argmax()) == 2 and s[0] == 0 and s[1] == 0 and s[3] == 0


def _tiny(tmp_path):
    LlamaEngine.random("tiny", seed=3, std=0.1).save_pretrained(tmp_path)
    return LlamaEngine.from_pretrained(tmp_path)


def test_observe_many_is_observe_per_request_in_any_batch(tmp_path):
    engine = _tiny(tmp_path)
    g = torch.Generator().manual_seed(7)
    reqs = []
    for n, m, q in ((0, 5, 3), (7, 4, 0), (3, 9, 2), (12, 3, 5)):
        toks = torch.randint(0, 256, (n + m + q,), generator=g).tolist()
        reqs.append((toks, (n, n + m), (n + m, n + m + q)))
    for batch in (1, 3, 8):
        for want, got in zip((obs.observe(engine, *r) for r in reqs), obs.observe_many(engine, reqs, batch=batch)):
            assert torch.allclose(got.received, want.received, atol=1e-5)
            assert torch.allclose(got.received_per_layer.sum(0), got.received, atol=1e-6)
            for (k1, v1), (k2, v2) in zip(want.kv, got.kv):
                assert torch.allclose(k1, k2, atol=1e-4) and torch.allclose(v1, v2, atol=1e-5)
