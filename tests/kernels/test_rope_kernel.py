"""RoPE: reference vs transformers' Llama rotary code, Triton vs reference, and the
properties blended prefill relies on (inverse, moving a chunk)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

import kvkernels as K
from kvkernels import RopeConfig, apply_rope_reference, apply_rope_triton, inv_freq, rope_tables, rotate

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
TOL = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
}


def _hf_config(head_dim: int, scaled: bool) -> LlamaConfig:
    heads = 4
    return LlamaConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_theta=500000.0 if scaled else 10000.0,
        rope_scaling=dict(LLAMA3_SCALING) if scaled else None,
    )


def _cfgs() -> list[RopeConfig]:
    return [RopeConfig(head_dim=32), RopeConfig(head_dim=64, theta=500000.0, factor=8.0)]


@pytest.mark.parametrize("scaled", [False, True], ids=["default", "llama3"])
def test_reference_matches_transformers_llama_rotary(scaled: bool) -> None:
    torch.manual_seed(0)
    head_dim, T = 64, 29
    hf = _hf_config(head_dim, scaled)
    rotary = LlamaRotaryEmbedding(hf)
    x = torch.randn(1, 4, T, head_dim)  # [B, H, T, D]
    positions = torch.randint(0, 100_000, (T,))  # arbitrary, far past 8192: scaling matters
    cos, sin = rotary(x, positions[None, :])
    expected, _ = apply_rotary_pos_emb(x, x, cos, sin)

    cfg = RopeConfig.from_hf_config(hf.to_dict())
    assert cfg.factor == (8.0 if scaled else None)
    torch.testing.assert_close(inv_freq(cfg), rotary.inv_freq, atol=0, rtol=0)
    got = apply_rope_reference(x[0], positions, cfg)
    torch.testing.assert_close(got, expected[0], atol=1e-5, rtol=1e-5)


def test_from_hf_config_reads_transformers4_and_5_layouts_alike() -> None:
    v4 = {"hidden_size": 256, "num_attention_heads": 4, "rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING}
    v5 = {"hidden_size": 256, "num_attention_heads": 4, "rope_parameters": {**LLAMA3_SCALING, "rope_theta": 500000.0}}
    expected = RopeConfig(head_dim=64, theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)
    assert RopeConfig.from_hf_config(v4) == expected
    assert RopeConfig.from_hf_config(v5) == expected
    plain = RopeConfig.from_hf_config({"hidden_size": 64, "num_attention_heads": 2, "head_dim": 16})
    assert plain == RopeConfig(head_dim=16, theta=10000.0)


def test_from_hf_config_refuses_unsupported_rope_type() -> None:
    config = {"hidden_size": 64, "num_attention_heads": 2, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ValueError, match="yarn"):
        RopeConfig.from_hf_config(config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("H,T", [(1, 1), (2, 17), (3, 45)])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("cfg", _cfgs(), ids=["plain32", "llama3_64"])
def test_triton_matches_reference(dtype: torch.dtype, H: int, T: int, inverse: bool, cfg: RopeConfig) -> None:
    torch.manual_seed(H * 100 + T)
    x = torch.randn(H, T, cfg.head_dim).to(dtype)
    positions = torch.randint(0, 20_000, (T,))
    expected = apply_rope_reference(x, positions, cfg, inverse=inverse)
    got = apply_rope_triton(x, positions, cfg, inverse=inverse)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), **TOL[dtype])


def test_triton_reads_and_writes_strided_views() -> None:
    torch.manual_seed(1)
    cfg = RopeConfig(head_dim=32)
    x = torch.randn(21, 3, 32).transpose(0, 1)  # [H, T, D] view of a [T, H, D] buffer
    positions = torch.randint(0, 4000, (21,))
    out = torch.empty(3, 32, 21).transpose(1, 2)  # [H, T, D] with a non-unit last stride
    apply_rope_triton(x, positions, cfg, out=out)
    torch.testing.assert_close(out, apply_rope_reference(x.contiguous(), positions, cfg), **TOL[torch.float32])


@pytest.mark.parametrize("impl", [apply_rope_reference, apply_rope_triton], ids=["reference", "triton"])
def test_out_is_x_rotates_in_place(impl) -> None:
    torch.manual_seed(2)
    cfg = RopeConfig(head_dim=32)
    x = torch.randn(2, 19, 32)
    positions = torch.randint(0, 1000, (19,))
    expected = apply_rope_reference(x.clone(), positions, cfg)
    result = impl(x, positions, cfg, out=x)
    assert result is x
    torch.testing.assert_close(x, expected, **TOL[torch.float32])


@pytest.mark.parametrize("impl", [apply_rope_reference, apply_rope_triton], ids=["reference", "triton"])
@pytest.mark.parametrize("cfg", _cfgs(), ids=["plain32", "llama3_64"])
def test_inverse_undoes_apply(impl, cfg: RopeConfig) -> None:
    torch.manual_seed(3)
    x = torch.randn(2, 23, cfg.head_dim)
    positions = torch.randint(0, 30_000, (23,))
    rotated = impl(x, positions, cfg)
    assert (rotated - x).abs().max() > 0.1  # the rotation did something
    torch.testing.assert_close(impl(rotated, positions, cfg, inverse=True), x, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", [apply_rope_reference, apply_rope_triton], ids=["reference", "triton"])
def test_chunk_cached_at_offset_zero_then_moved_equals_computed_at_offset(impl) -> None:
    # Cache-Craft §3.4.3 / CacheBlend footnote 3: a chunk's K cached at positions 0..L-1
    # is reused at p..p+L-1 by removing the old rotation and applying the new one.
    torch.manual_seed(4)
    cfg = RopeConfig(head_dim=64, theta=500000.0, factor=8.0)
    L, p = 37, 9001
    k_raw = torch.randn(4, L, 64)  # K before RoPE
    at_zero = torch.arange(L)
    cached = impl(k_raw, at_zero, cfg)
    moved = impl(impl(cached, at_zero, cfg, inverse=True), at_zero + p, cfg)
    computed_at_p = apply_rope_reference(k_raw, at_zero + p, cfg)
    torch.testing.assert_close(moved, computed_at_p, atol=3e-5, rtol=1e-5)


def test_rejects_mismatched_positions() -> None:
    cfg = RopeConfig(head_dim=16)
    with pytest.raises(ValueError, match="positions"):
        apply_rope_reference(torch.randn(1, 4, 16), torch.arange(5), cfg)
    with pytest.raises(ValueError, match="head dim"):
        apply_rope_triton(torch.randn(1, 4, 8), torch.arange(4), cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tables_computed_once_rotate_any_rows_like_the_reference(dtype: torch.dtype) -> None:
    # The blend driver builds cos/sin for positions 0..N-1 once and indexes rows out of them.
    cfg = RopeConfig(head_dim=32, theta=500000.0, factor=8.0, original_max_position_embeddings=64)
    cos, sin = rope_tables(cfg, torch.arange(300))
    x = torch.randn(3, 40, 32).to(dtype)
    rows = torch.randperm(300, generator=torch.Generator().manual_seed(1))[:40]
    assert torch.equal(rotate(x, cos[rows], sin[rows]), apply_rope_reference(x, rows, cfg))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotate_triton_equals_the_reference_bit_for_bit(dtype: torch.dtype) -> None:
    # The one-launch rotation the blend loop runs on a GPU: x strided as the engine hands
    # it over (q/k are transposed views of one projection), tables indexed by rows.
    cfg = RopeConfig(head_dim=64, theta=100000.0)
    cos, sin = rope_tables(cfg, torch.arange(700))
    rows = torch.randperm(700, generator=torch.Generator().manual_seed(2))[:37]
    qkv = torch.randn(37, 5, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    x = qkv.transpose(0, 1)  # [H=5, T=37, D], not contiguous
    got = K.rotate_triton(x, cos[rows], sin[rows])
    assert got.is_contiguous() and got.dtype == dtype
    ref = K.rotate_reference(x, cos[rows], sin[rows])
    assert torch.equal(ref, apply_rope_reference(x.contiguous(), rows, cfg))
    if dtype == torch.bfloat16:
        # The interpreter rounds fp32 to bf16 toward zero (compiled Triton and torch round to
        # nearest: bit for bit on a GPU, tests/kernels/test_gpu_kernels.py): one bf16 ulp.
        ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs()
        assert ((got.float() - ref.float()).abs() <= ulp).all()
    else:
        assert torch.equal(got, ref)


def test_rotate_triton_refuses_tables_of_other_rows() -> None:
    cos, sin = rope_tables(RopeConfig(head_dim=16), torch.arange(4))
    with pytest.raises(ValueError, match="cos and sin must be"):
        K.rotate_triton(torch.randn(2, 5, 16), cos, sin)
    with pytest.raises(ValueError, match="fp32"):
        K.rotate_triton(torch.randn(2, 4, 16), cos.half(), sin.half())


def test_rotate_triton_into_a_given_tensor_writes_there_and_refuses_x_itself() -> None:
    # The static step rotates a layer's stored K into the layer's cache, a view of a buffer
    # kept for every layer (engine_adapter.graphs).
    cos, sin = rope_tables(RopeConfig(head_dim=16), torch.arange(6))
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(4))
    caches = torch.zeros(3, 2, 6, 16)
    got = K.rotate_triton(x, cos, sin, out=caches[1])
    assert got.data_ptr() == caches[1].data_ptr()
    assert torch.equal(caches[1], K.rotate_reference(x, cos, sin))
    assert not caches[0].any() and not caches[2].any()
    with pytest.raises(ValueError, match="apart from x"):
        K.rotate_triton(x, cos, sin, out=x)
    with pytest.raises(ValueError, match="apart from x"):
        K.rotate_triton(x, cos, sin, out=torch.empty(2, 5, 16))
