"""The reference engine against transformers' LlamaForCausalLM, same weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaForCausalLM

from engine_adapter.llama import LlamaConfig, LlamaEngine

LLAMA3_SCALING = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                  ("original_max_position_embeddings", 64), ("rope_type", "llama3"))
CONFIGS = {
    "tiny": LlamaConfig.named("tiny"),
    "tiny-llama3-rope-tied": dataclasses.replace(LlamaConfig.named("tiny"), rope_theta=500000.0,
                                                 rope_scaling=LLAMA3_SCALING, tie_word_embeddings=True),
}


def _both(cfg: LlamaConfig, tmp_path, dtype=torch.float32):
    LlamaEngine.random(cfg, seed=3, std=0.1).save_pretrained(tmp_path)
    hf = LlamaForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
    return LlamaEngine.from_pretrained(tmp_path, dtype=dtype), hf


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_full_prefill_matches_transformers_fp32(name, tmp_path):
    ours, hf = _both(CONFIGS[name], tmp_path)
    tokens = torch.randint(0, 256, (160,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(tokens[None]).logits[0]
    logits, kv = ours.prefill(tokens)
    assert (logits - ref).abs().max() < 1e-4
    assert len(kv) == ours.cfg.num_layers and kv[0][0].shape == (2, 160, 16)


def test_full_prefill_bf16_within_measured_tolerance(tmp_path):
    # Measured: max |logit diff| ~0.055 vs transformers in bf16 (logits up to ~3.7); bound 0.1.
    ours, hf = _both(CONFIGS["tiny"], tmp_path, dtype=torch.bfloat16)
    tokens = torch.randint(0, 256, (160,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(tokens[None]).logits[0].float()
    logits, _ = ours.prefill(tokens)
    assert logits.dtype == torch.bfloat16
    assert (logits.float() - ref).abs().max() < 0.1


def test_config_reads_both_hf_rope_layouts():
    v5 = CONFIGS["tiny-llama3-rope-tied"].to_hf()
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4 |= {"rope_theta": 500000.0, "rope_scaling": dict(LLAMA3_SCALING)}
    assert LlamaConfig.from_hf(v4, name="x") == LlamaConfig.from_hf(v5, name="x")
    assert LlamaConfig.from_hf(v5, name="x").rope().factor == 8.0


def test_model_spec_fingerprint_covers_rope_and_dtype():
    cfg = LlamaConfig.named("tiny")
    spec = LlamaEngine.random(cfg).model_spec()
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype) == (4, 2, 16, "float32")
    other_base = LlamaEngine.random(dataclasses.replace(cfg, rope_theta=5e5)).model_spec()
    bf16 = LlamaEngine.random(cfg, dtype=torch.bfloat16).model_spec()
    assert len({spec.fingerprint(), other_base.fingerprint(), bf16.fingerprint()}) == 3


def test_named_shapes():
    big = LlamaConfig.named("llama3-8b")
    assert (big.num_layers, big.hidden_size, big.num_kv_heads, big.head_dim, big.rope_theta) == (
        32, 4096, 8, 128, 500000.0)
    with pytest.raises(ValueError, match="unknown model shape"):
        LlamaConfig.named("gpt-5")


def test_missing_weights_are_refused():
    eng = LlamaEngine.random("tiny")
    w = dict(eng.w)
    del w["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="weights lack"):
        LlamaEngine(eng.cfg, w)
