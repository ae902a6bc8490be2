"""The fused layer kernels (kvkernels.layer): each Triton kernel against its torch
reference under the interpreter, and each reference against an independent one
(transformers' Llama modules; RoPE from the positions, not the tables)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from kvkernels import RopeConfig, apply_rope_reference, rope_tables
from kvkernels.layer import (
    add_rms_norm,
    add_rms_norm_reference,
    add_rms_norm_triton,
    rope_write,
    rope_write_reference,
    rope_write_triton,
    rms_norm_reference,
    rms_norm_triton,
    silu_mul,
    silu_mul_reference,
    silu_mul_triton,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _close_or_ulp(got: torch.Tensor, ref: torch.Tensor, ulps: int = 1) -> None:
    """fp32/fp16: close. bf16: within `ulps` bf16 ulps (one per rounding on the way), as the
    interpreter rounds fp32 to bf16 toward zero (compiled Triton and torch round to nearest;
    docs/kernels.md)."""
    if ref.dtype == torch.bfloat16:
        ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs()
        assert bool(((got.float() - ref.float()).abs() <= ulp * (ulps + 0.01) + 1e-30).all())
    else:
        torch.testing.assert_close(got, ref, atol=1e-5 if ref.dtype == torch.float32 else 2e-3, rtol=1e-5)


def test_add_rms_norm_reference_is_transformers_rmsnorm() -> None:
    torch.manual_seed(0)
    d = 64
    norm = LlamaRMSNorm(d, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(d))
    h, delta = torch.randn(9, d), torch.randn(9, d)
    s, y = add_rms_norm_reference(h, delta, norm.weight.detach(), 1e-5)
    torch.testing.assert_close(s, h + delta, atol=0, rtol=0)
    torch.testing.assert_close(y, norm(h + delta).detach(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 64), (37, 96), (5, 576)])
def test_add_rms_norm_triton_matches_reference(dtype: torch.dtype, rows: int, d: int) -> None:
    g = torch.Generator().manual_seed(rows + d)
    h = (torch.randn(rows, d, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, d, generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype)
    s, y = add_rms_norm_triton(h, delta, w, 1e-5)
    s0, y0 = add_rms_norm_reference(h, delta, w, 1e-5)
    _close_or_ulp(s, s0)
    _close_or_ulp(y, y0, ulps=4)  # s's rounding carried, the normalised row's, the product's
    s1, y1 = add_rms_norm(h, delta, w, 1e-5)  # CPU tensors: the reference
    assert torch.equal(s1, s0) and torch.equal(y1, y0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_triton_matches_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(23, 96, generator=g) * 3).to(dtype)
    w = (1 + 0.2 * torch.randn(96, generator=g)).to(dtype)
    _close_or_ulp(rms_norm_triton(x, w, 1e-5), rms_norm_reference(x, w, 1e-5), ulps=2)  # normalised row, product
    _close_or_ulp(rms_norm_triton(x.t().contiguous().t(), w, 1e-5), rms_norm_reference(x, w, 1e-5), ulps=2)


def test_add_rms_norm_strided_rows_and_refusals() -> None:
    h = torch.randn(16, 8).t()  # [8, 16], column-major
    delta, w = torch.randn(8, 16), torch.ones(16)
    s, y = add_rms_norm_triton(h, delta, w, 1e-6)
    s0, y0 = add_rms_norm_reference(h, delta, w, 1e-6)
    torch.testing.assert_close(s, s0)
    torch.testing.assert_close(y, y0)
    with pytest.raises(ValueError, match="one \\[R, d\\] shape"):
        add_rms_norm_triton(h, delta[:4], w, 1e-6)
    with pytest.raises(ValueError, match="share a dtype"):
        add_rms_norm_triton(h, delta.half(), w, 1e-6)


def test_silu_mul_reference_is_transformers_mlp_activation() -> None:
    torch.manual_seed(1)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="silu")
    mlp = LlamaMLP(cfg)
    x = torch.randn(7, 32)
    gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1).detach()
    got = silu_mul_reference(gate_up) @ mlp.down_proj.weight.detach().T
    torch.testing.assert_close(got, mlp(x).detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 8), (37, 150), (20, 1536)])
def test_silu_mul_triton_matches_reference(dtype: torch.dtype, rows: int, inter: int) -> None:
    g = torch.Generator().manual_seed(rows * inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    got, ref = silu_mul_triton(gate_up), silu_mul_reference(gate_up)
    if dtype == torch.bfloat16:  # rounded twice (SiLU, then the product), each toward zero
        ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs()
        assert bool(((got.float() - ref.float()).abs() <= 4.01 * ulp + 1e-30).all())
    else:
        torch.testing.assert_close(got, ref, atol=1e-5 if dtype == torch.float32 else 2e-3, rtol=1e-3)
    assert torch.equal(silu_mul(gate_up), ref)
    with pytest.raises(ValueError, match="\\[R, 2I\\]"):
        silu_mul_triton(gate_up[:, 1:])


def _qkv_case(dtype: torch.dtype, heads: int, hkv: int, rows: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    D = 32
    qkv = torch.randn(rows, heads + 2 * hkv, D, generator=g).to(dtype).transpose(0, 1)  # strided, as the matmul's
    at = torch.randperm(n, generator=g)[:rows]
    pos = at + 7  # the cache row's position
    K = torch.randn(hkv, n, D, generator=g).to(dtype)
    V = torch.randn(hkv, n, D, generator=g).to(dtype)
    return qkv, at, pos, K, V, RopeConfig(head_dim=D)


def test_rope_write_reference_is_rope_at_positions_then_writes() -> None:
    qkv, at, pos, K, V, cfg = _qkv_case(torch.float32, 4, 2, 11, 30, 0)
    K0, V0 = K.clone(), V.clone()
    cos, sin = rope_tables(cfg, pos)
    q = rope_write_reference(qkv, 4, cos, sin, at, K, V)
    torch.testing.assert_close(q, apply_rope_reference(qkv[:4], pos, cfg), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(K[:, at], apply_rope_reference(qkv[4:6], pos, cfg), atol=1e-6, rtol=1e-6)
    assert torch.equal(V[:, at], qkv[6:])
    others = torch.ones(30, dtype=torch.bool)
    others[at] = False
    assert torch.equal(K[:, others], K0[:, others]) and torch.equal(V[:, others], V0[:, others])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,hkv,rows,n", [(4, 4, 1, 5), (6, 2, 19, 50), (8, 1, 40, 40)])
def test_rope_write_triton_matches_reference(dtype: torch.dtype, heads: int, hkv: int, rows: int, n: int) -> None:
    qkv, at, pos, K, V, cfg = _qkv_case(dtype, heads, hkv, rows, n, heads * rows)
    cos, sin = rope_tables(cfg, pos)
    K1, V1 = K.clone(), V.clone()
    q = rope_write_triton(qkv, heads, cos, sin, at, K, V)
    q0 = rope_write_reference(qkv, heads, cos, sin, at, K1, V1)
    assert torch.equal(V, V1)  # a copy, no arithmetic
    _close_or_ulp(q, q0)
    _close_or_ulp(K, K1)
    if dtype != torch.bfloat16:  # no fused multiply-adds: the reference's rounding exactly
        assert torch.equal(q, q0) and torch.equal(K, K1)
    K2, V2 = K1.clone(), V1.clone()
    assert torch.equal(rope_write(qkv, heads, cos, sin, at, K2, V2), rope_write_reference(qkv, heads, cos, sin, at, K1, V1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,hkv,rows,n", [(4, 2, 1, 5), (6, 2, 19, 50), (8, 1, 40, 40)])
def test_rope_write_with_the_stored_k_rotates_it_into_every_key_no_row_writes(dtype: torch.dtype, heads: int,
                                                                              hkv: int, rows: int, n: int) -> None:
    # The merge's rotation in the rows' launch: K is the stored K rotated to the keys'
    # positions, then the rows' k over it at their rows (as two separate steps would leave
    # it: RoPE from the positions, not the launch's tables), V the stored V with the rows' v.
    qkv, at, pos, _, V, cfg = _qkv_case(dtype, heads, hkv, rows, n, 7 * rows + n)
    g = torch.Generator().manual_seed(n)
    raw = torch.randn(hkv, n, 32, generator=g).to(dtype)
    key_pos = torch.arange(n) + 7
    cos, sin = rope_tables(cfg, pos)
    stored = (raw, *rope_tables(cfg, key_pos), torch.zeros(n, dtype=torch.bool).index_fill_(0, at, True))
    K = torch.full_like(raw, float("nan"))  # no key left unwritten
    V0 = V.clone()
    q = rope_write_triton(qkv, heads, cos, sin, at, K, V, stored)
    K1, V1 = torch.empty_like(raw), V0.clone()
    q1 = rope_write_reference(qkv, heads, cos, sin, at, K1, V1, stored)
    assert torch.equal(V, V1)
    _close_or_ulp(q, q1)
    _close_or_ulp(K, K1)
    if dtype != torch.bfloat16:
        assert torch.equal(q, q1) and torch.equal(K, K1)
    expect = apply_rope_reference(raw, key_pos, cfg)
    expect[:, at] = apply_rope_reference(qkv[heads:heads + hkv], pos, cfg)
    torch.testing.assert_close(K1.float(), expect.float(), atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-3)
    with pytest.raises(ValueError, match="computed must be bool"):
        rope_write_triton(qkv, heads, cos, sin, at, K, V, (*stored[:3], stored[3].long()))
    with pytest.raises(ValueError, match="apart from K"):
        rope_write_triton(qkv, heads, cos, sin, at, K, V, (K, *stored[1:]))


def test_rope_write_refuses_mismatched_shapes() -> None:
    qkv, at, pos, K, V, cfg = _qkv_case(torch.float32, 4, 2, 11, 30, 0)
    cos, sin = rope_tables(cfg, pos)
    with pytest.raises(ValueError, match="heads \\+ 2 Hkv"):
        rope_write_triton(qkv, 3, cos, sin, at, K, V)
    with pytest.raises(ValueError, match="rope_tables at the rows"):
        rope_write_triton(qkv, 4, cos[:5], sin[:5], at, K, V)
    with pytest.raises(ValueError, match="rows must be integer"):
        rope_write_triton(qkv, 4, cos, sin, at.float(), K, V)
