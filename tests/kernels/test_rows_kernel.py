"""Row gather/scatter: both implementations vs a per-row loop, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvkernels import gather_rows_reference, gather_rows_triton, scatter_rows_reference, scatter_rows_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("gather", [gather_rows_reference, gather_rows_triton], ids=["reference", "triton"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_copies_the_indexed_rows_exactly(gather, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    buffer = torch.randn(45, 3, 24, generator=g).to(dtype)
    buffer[7, 1, 5] = float("nan")
    buffer[2, 0, 0] = -0.0
    src = buffer.transpose(0, 1)  # [H, T, D] strided view
    idx = torch.tensor([44, 7, 0, 7, 19, 2, 31])  # random order, one repeat
    out = gather(src, idx)
    expected = torch.stack([src[:, int(i)] for i in idx], dim=1)
    assert out.shape == (3, 7, 24) and out.dtype == dtype
    assert torch.equal(_bits(out), _bits(expected))


@pytest.mark.parametrize("scatter", [scatter_rows_reference, scatter_rows_triton], ids=["reference", "triton"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_writes_only_the_indexed_rows_in_place(scatter, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    buffer = torch.randn(2, 3, 37, 20, generator=g).to(dtype)  # [layers, H, T, D]
    before = buffer.clone()
    dst = buffer[1]  # one layer's view
    idx = torch.tensor([36, 0, 11, 5])
    rows = torch.randn(3, 4, 20, generator=g).to(dtype)
    result = scatter(dst, idx, rows)
    assert result is dst
    expected = before.clone()
    for r, t in enumerate(idx.tolist()):
        expected[1, :, t] = rows[:, r]
    assert torch.equal(_bits(buffer), _bits(expected))


def test_scatter_into_strided_destination() -> None:
    g = torch.Generator().manual_seed(3)
    buffer = torch.randn(50, 2, 16, generator=g)
    dst = buffer.transpose(0, 1)  # [H, T, D] view of [T, H, D]
    idx = torch.randperm(50, generator=g)[:9]
    rows = torch.randn(2, 9, 16, generator=g)
    scatter_rows_triton(dst, idx, rows)
    assert torch.equal(buffer[idx].transpose(0, 1), rows)


@pytest.mark.parametrize("fn", [gather_rows_reference, gather_rows_triton], ids=["reference", "triton"])
def test_out_of_range_index_is_refused(fn) -> None:
    src = torch.zeros(1, 5, 16)
    with pytest.raises(IndexError):
        fn(src, torch.tensor([0, 5]))
    with pytest.raises(IndexError):
        fn(src, torch.tensor([-1]))


def test_scatter_rejects_rows_of_wrong_shape() -> None:
    with pytest.raises(ValueError, match="rows"):
        scatter_rows_triton(torch.zeros(2, 5, 16), torch.tensor([1, 2]), torch.zeros(2, 3, 16))
