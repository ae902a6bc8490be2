"""The reference engine against transformers' LlamaForCausalLM, same weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaForCausalLM

from engine_adapter.llama import ATTENTION_RUNS, LlamaConfig, LlamaEngine, RowBlocks
from kvkernels import selective_attention_reference

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


# `attend` on CPU (what a prefill's attention runs there) vs kvkernels' reference; the
# tolerances of tests/kernels/test_attention_kernel.py.
ATTEND_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
              torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}


def _position_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the blend driver builds once per set of rows: 0 where key j is visible to row r."""
    return torch.zeros(len(q_pos), len(k_pos), dtype=dtype).masked_fill_(k_pos[None, :] > q_pos[:, None],
                                                                         float("-inf"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 1), (12, 4)], ids=["mha", "gqa4", "gqa3"])
@pytest.mark.parametrize("R,T", [(1, 37), (13, 45), (50, 50)], ids=["one_row", "subset", "all_rows"])
def test_attend_on_cpu_with_the_callers_mask_matches_the_reference(dtype, Hq, Hkv, R, T):
    engine = LlamaEngine.random("tiny")
    g = torch.Generator().manual_seed(R * 1000 + T + Hq + 1)
    q = torch.randn(Hq, R, 16, generator=g).to(dtype)
    k, v = (torch.randn(Hkv, T, 16, generator=g).to(dtype) for _ in range(2))
    k_pos = torch.arange(T) + 100
    q_pos = k_pos[torch.randperm(T, generator=g)[:R]]  # each row is a key too: it sees at least itself
    expected, _ = selective_attention_reference(q, q_pos, k, v, k_pos, scale=engine.scale)
    got = engine.attend(q, q_pos, k, v, k_pos, _position_mask(q_pos, k_pos, dtype))
    assert got.dtype == dtype and got.shape == (Hq, R, 16)
    torch.testing.assert_close(got.float(), expected.float(), **ATTEND_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R", [1, 2, 9, 40])
def test_attend_on_cpu_in_runs_of_rows_matches_the_reference(dtype, R):
    # The blend's rows: sorted prompt rows, the keys at their positions, the last row computed.
    engine = LlamaEngine.random("tiny")
    T = 60
    g = torch.Generator().manual_seed(R)
    q = torch.randn(4, R, 16, generator=g).to(dtype)
    k, v = (torch.randn(2, T, 16, generator=g).to(dtype) for _ in range(2))
    pos = torch.arange(T)
    q_pos = torch.cat((torch.randperm(T - 1, generator=g)[:R - 1].sort().values, torch.tensor([T - 1])))
    blocks = RowBlocks.of((q_pos + 1).tolist(), _position_mask(q_pos, pos, dtype), 4, 16)
    assert len(blocks.sizes) == ATTENTION_RUNS and sum(blocks.sizes) == R
    expected, _ = selective_attention_reference(q, q_pos, k, v, pos, scale=engine.scale)
    for _ in range(2):  # the runs' output buffer is written again by the next layer
        got = engine.attend(q, q_pos, k, v, pos, blocks)
        assert got.dtype == dtype and got.shape == (4, R, 16)
        torch.testing.assert_close(got.float(), expected.float(), **ATTEND_TOL[dtype])


def test_runs_of_rows_read_the_keys_up_to_their_last_row_cut_where_that_reads_fewest():
    # rows 0..9 then 90..99 of 100 keys (two runs): the cut between them, 10 x 10 + 10 x 100 keys
    assert ATTENTION_RUNS == 2
    rows = list(range(10)) + list(range(90, 100))
    blocks = RowBlocks.of([r + 1 for r in rows], torch.zeros(20, 100), 4, 16)
    assert blocks.sizes == (10, 10) and blocks.ends == (10,)
    assert [m.shape for m in blocks.masks] == [(10, 10), (10, 100)]


def test_attend_on_cpu_keys_out_of_position_order_and_strided_inputs():
    engine = LlamaEngine.random("tiny")
    T = 29
    k = torch.randn(T, 2, 16).transpose(0, 1)  # [Hkv, T, D] views of [T, H, D] buffers
    v = torch.randn(T, 2, 16).transpose(0, 1)
    q = torch.randn(8, 4, 16).transpose(0, 1)
    k_pos = torch.arange(T) + 3
    q_pos = torch.tensor([31, 3, 14, 5, 21, 9, 4, 17])
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(8))
    got = engine.attend(q, q_pos, k[:, perm], v[:, perm], k_pos[perm], _position_mask(q_pos, k_pos[perm], q.dtype))
    expected, _ = selective_attention_reference(q.contiguous(), q_pos, k.contiguous(), v.contiguous(), k_pos,
                                                scale=engine.scale)
    torch.testing.assert_close(got, expected, **ATTEND_TOL[torch.float32])


def test_attend_on_cpu_without_a_mask_is_causal_over_every_row():
    engine = LlamaEngine.random("tiny")
    q, k, v = torch.randn(4, 40, 16), torch.randn(2, 40, 16), torch.randn(2, 40, 16)
    pos = torch.arange(40)
    expected, _ = selective_attention_reference(q, pos, k, v, pos, scale=engine.scale)
    torch.testing.assert_close(engine.attend(q, pos, k, v, pos, None), expected, **ATTEND_TOL[torch.float32])
