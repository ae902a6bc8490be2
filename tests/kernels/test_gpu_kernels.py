"""Compiled Triton kernels vs their references on CUDA, at a Llama-3-8B layer's shape.

The CPU runs check the same kernels through the interpreter at small shapes; these
check the compiled code paths (fp16/bf16 tensor-core dots, 64x64 tiles) on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import kvkernels as K

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_selective_attention_llama3_8b_shape(dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    T, D = 2500, 128
    q_all = torch.randn(32, T, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(8, T, D, device="cuda", generator=g).to(dtype)
    v = torch.randn(8, T, D, device="cuda", generator=g).to(dtype)
    pos = torch.arange(T, device="cuda")
    rows = torch.randperm(T, device="cuda", generator=g)[: T * 15 // 100]
    segments = torch.tensor([0, 512, 1024, 1536, 2048, T], device="cuda")
    got, mass = K.selective_attention_triton(q_all[:, rows], rows, k, v, pos, segments=segments)
    expected, expected_mass = K.selective_attention_reference(q_all[:, rows], rows, k, v, pos, segments=segments)
    torch.testing.assert_close(got.float(), expected.float(), **TOL[dtype])
    torch.testing.assert_close(mass, expected_mass, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_deviation_llama3_8b_shape(dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    T = 2500
    cfg = K.RopeConfig(head_dim=128, theta=500000.0, factor=8.0)
    x = torch.randn(8, T, 128, device="cuda", generator=g).to(dtype)
    pos = torch.randint(0, 100_000, (T,), device="cuda", generator=g)
    torch.testing.assert_close(
        K.apply_rope_triton(x, pos, cfg).float(), K.apply_rope_reference(x, pos, cfg).float(), **TOL[dtype]
    )
    kv = [torch.randn(8, T, 128, device="cuda", generator=g).to(dtype) for _ in range(4)]
    dev, _ = K.kv_deviation_topk_triton(*kv, 0.15)
    expected_dev, _ = K.kv_deviation_topk_reference(*kv, 0.15)
    torch.testing.assert_close(dev, expected_dev, atol=1e-2, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rotate_llama3_8b_shape_bit_for_bit(dtype: torch.dtype) -> None:
    # The blend loop's rotation (merged cache, computed rows) must equal the torch
    # arithmetic exactly on the GPU too: exact reuse then equals full prefill.
    g = torch.Generator(device="cuda").manual_seed(2)
    T = 2500
    cos, sin = K.rope_tables(K.RopeConfig(head_dim=128, theta=500000.0, factor=8.0), torch.arange(T, device="cuda"))
    rows = torch.randperm(T, device="cuda", generator=g)[:375]
    x = torch.randn(375, 32, 128, device="cuda", generator=g).to(dtype).transpose(0, 1)  # [H, R, D] strided
    assert torch.equal(K.rotate_triton(x, cos[rows], sin[rows]), K.rotate_reference(x, cos[rows], sin[rows]))
    assert torch.equal(K.rotate(x, cos[rows], sin[rows]), K.rotate_triton(x, cos[rows], sin[rows]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_kernels_llama3_8b_shape(dtype: torch.dtype) -> None:
    # The fused element-wise steps of a layer (kvkernels.layer): round as torch does
    # (round to nearest on the GPU), so only a reduction's order and the sigmoid differ.
    from kvkernels import layer

    g = torch.Generator(device="cuda").manual_seed(3)
    R, d, inter = 375, 4096, 14336
    h, delta = (torch.randn(R, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).to(dtype)
    s, y = layer.add_rms_norm_triton(h, delta, w, 1e-5)
    s0, y0 = layer.add_rms_norm_reference(h, delta, w, 1e-5)
    assert torch.equal(s, s0)
    torch.testing.assert_close(y.float(), y0.float(), **TOL[dtype])
    gate_up = torch.randn(R, 2 * inter, device="cuda", generator=g).to(dtype)
    torch.testing.assert_close(layer.silu_mul_triton(gate_up).float(), layer.silu_mul_reference(gate_up).float(),
                               **TOL[dtype])
    T = 2500
    cos, sin = K.rope_tables(K.RopeConfig(head_dim=128, theta=500000.0, factor=8.0), torch.arange(T, device="cuda"))
    rows = torch.randperm(T, device="cuda", generator=g)[:R]
    qkv = torch.randn(R, 48, 128, device="cuda", generator=g).to(dtype).transpose(0, 1)  # [32+8+8, R, D] strided
    caches = [torch.randn(8, T, 128, device="cuda", generator=g).to(dtype) for _ in range(2)]
    copies = [c.clone() for c in caches]
    q = layer.rope_write_triton(qkv, 32, cos[rows], sin[rows], rows, *caches)
    q0 = layer.rope_write_reference(qkv, 32, cos[rows], sin[rows], rows, *copies)
    assert torch.equal(q, q0) and torch.equal(caches[0], copies[0]) and torch.equal(caches[1], copies[1])
    raw = torch.randn(8, T, 128, device="cuda", generator=g).to(dtype)  # the stored K, rotated in the same launch
    stored = (raw, cos, sin, torch.zeros(T, dtype=torch.bool, device="cuda").index_fill_(0, rows, True))
    q = layer.rope_write_triton(qkv, 32, cos[rows], sin[rows], rows, *caches, stored)
    q0 = layer.rope_write_reference(qkv, 32, cos[rows], sin[rows], rows, *copies, stored)
    assert torch.equal(q, q0) and torch.equal(caches[0], copies[0]) and torch.equal(caches[1], copies[1])
