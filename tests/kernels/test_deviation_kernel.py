"""KV deviation + HKVD top-k (CacheBlend §4): references vs a per-token loop, Triton vs reference."""

from __future__ import annotations

import math

import pytest
import torch

from kvkernels import kv_deviation_topk_reference, kv_deviation_topk_triton
from kvkernels.deviation import num_selected

IMPLS = [kv_deviation_topk_reference, kv_deviation_topk_triton]
IDS = ["reference", "triton"]


def _kv(H: int, T: int, D: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(H, T, D, generator=g).to(dtype) for _ in range(4)]


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_deviation_is_l1_of_kv_difference_per_token(impl) -> None:
    k_new, v_new, k_old, v_old = _kv(3, 11, 24, torch.float32, seed=1)
    dev, idx = impl(k_new, v_new, k_old, v_old, 0.3)
    expected = []
    for j in range(11):  # CacheBlend §4.1: |KV_new[j] - KV_old[j]|, over every head and dim
        total = 0.0
        for h in range(3):
            for d in range(24):
                total += abs(float(k_new[h, j, d]) - float(k_old[h, j, d]))
                total += abs(float(v_new[h, j, d]) - float(v_old[h, j, d]))
        expected.append(total)
    torch.testing.assert_close(dev, torch.tensor(expected, dtype=torch.float32), atol=1e-4, rtol=1e-5)
    top = sorted(sorted(range(11), key=lambda j: -expected[j])[: math.ceil(0.3 * 11)])
    assert idx.tolist() == top and idx.dtype == torch.int64


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_selects_the_planted_high_deviation_tokens(impl) -> None:
    k_new, v_new, _, _ = _kv(2, 40, 16, torch.float16, seed=2)
    k_old, v_old = k_new.clone(), v_new.clone()
    planted = [3, 17, 29, 38]
    k_old[:, [3, 29]] += 0.5  # deviation through K only ...
    v_old[:, [17, 38]] -= 0.5  # ... or through V only
    k_old[:, 10] += 0.01  # small deviation, must not be picked
    _, idx = impl(k_new, v_new, k_old, v_old, 0.1)
    assert idx.tolist() == planted


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_ties_go_to_the_lower_token_index(impl) -> None:
    k = torch.zeros(1, 10, 16)
    _, idx = impl(k, k, k + 1, k, 0.3)  # every token deviates by exactly 16
    assert idx.tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    "ratio,T,n", [(0.1, 30, 3), (0.15, 20, 3), (0.15, 21, 4), (0.0, 9, 0), (1.0, 9, 9), (0.5, 1, 1)]
)
def test_selects_ceil_of_ratio_times_tokens(ratio: float, T: int, n: int) -> None:
    assert num_selected(ratio, T) == n
    _, idx = kv_deviation_topk_reference(*_kv(1, T, 16, torch.float32, seed=T), ratio)
    assert idx.shape == (n,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("H,T,D", [(1, 1, 16), (8, 37, 24), (2, 45, 160)])
def test_triton_matches_reference(dtype: torch.dtype, H: int, T: int, D: int) -> None:
    kv = _kv(H, T, D, dtype, seed=H * 1000 + T + D)
    dev, idx = kv_deviation_topk_triton(*kv, 0.25)
    expected_dev, expected_idx = kv_deviation_topk_reference(*kv, 0.25)
    torch.testing.assert_close(dev, expected_dev, atol=1e-3, rtol=1e-5)
    assert torch.equal(idx, expected_idx)


def test_triton_reads_strided_inputs() -> None:
    g = torch.Generator().manual_seed(3)
    kv = [torch.randn(23, 4, 32, generator=g).transpose(0, 1) for _ in range(4)]  # [H, T, D] views
    dev, idx = kv_deviation_topk_triton(*kv, 0.2)
    expected_dev, expected_idx = kv_deviation_topk_reference(*[t.contiguous() for t in kv], 0.2)
    torch.testing.assert_close(dev, expected_dev, atol=1e-4, rtol=1e-5)
    assert torch.equal(idx, expected_idx)


def test_rejects_ratio_out_of_range_and_shape_mismatch() -> None:
    kv = _kv(1, 4, 16, torch.float32, seed=4)
    with pytest.raises(ValueError, match="ratio"):
        kv_deviation_topk_reference(*kv, 1.5)
    with pytest.raises(ValueError, match="shape"):
        kv_deviation_topk_triton(kv[0], kv[1], kv[2][:, :3], kv[3], 0.5)
