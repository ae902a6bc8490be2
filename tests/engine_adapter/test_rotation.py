"""The layer step's RoPE on the CPU (`step.Rotation`) against kvkernels' reference, bit for bit:
every dtype, the strided heads `qkv_heads` returns, into a buffer, rows picked by `at`, a batch
of prompts, Llama 3's scaled tables."""

from __future__ import annotations

import pytest
import torch

from engine_adapter.step import Rotation
from kvkernels import rotate_reference
from kvkernels.rope import RopeConfig, rope_tables

ROPES = {"plain": RopeConfig(head_dim=64, theta=10000.0),
         "llama3": RopeConfig(head_dim=64, theta=500000.0, factor=8.0, original_max_position_embeddings=64)}


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotation_is_the_references_arithmetic_bit_for_bit(rope, dtype):
    g = torch.Generator().manual_seed(7)
    T, H = 45, 6
    pos = torch.randperm(300, generator=g)[:T] + 5
    cos, sin = rope_tables(ROPES[rope], pos)
    rot = Rotation(cos, sin, False)
    heads = torch.randn(T, H + 2, 64, generator=g).to(dtype).transpose(0, 1)[:H]  # [H, T, D], as qkv_heads gives
    want = rotate_reference(heads, cos, sin)
    assert torch.equal(rot(heads), want)
    assert torch.equal(rot(heads.contiguous()), want)
    buf = torch.full((H, T, 64), float("nan"), dtype=dtype)
    assert rot(heads, out=buf) is buf and torch.equal(buf, want)
    idx = torch.tensor([3, 0, 44, 17])
    assert torch.equal(rot.at(idx)(heads[:, idx]), rotate_reference(heads[:, idx], cos[idx], sin[idx]))


def test_a_batch_of_prompts_rotates_each_at_its_own_positions():
    g = torch.Generator().manual_seed(8)
    B, H, T = 3, 4, 20
    pos = torch.stack([torch.randperm(100, generator=g)[:T] for _ in range(B)])  # [B, T]
    cos, sin = rope_tables(ROPES["plain"], pos.reshape(-1))
    cos, sin = cos.view(B, 1, T, 32), sin.view(B, 1, T, 32)
    x = torch.randn(B, H, T, 64, generator=g)
    got = Rotation(cos, sin, False)(x)
    for b in range(B):
        assert torch.equal(got[b], rotate_reference(x[b], cos[b, 0], sin[b, 0]))
