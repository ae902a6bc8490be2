"""Gather and scatter of token rows of a per-layer KV tensor.

Blended prefill (docs/adapter.md, "Per-layer timeline") reads the rows to recompute out of the
merged cache and writes the recomputed K/V back into it. torch's ``index_select`` and
``index_copy_`` are the reference; the Triton kernel does the same in one launch that
reads and writes through the tensors' strides (a layer view of a larger buffer needs
no contiguous copy), and keeps the whole CUDA path of the layer in kernels we own.

Rows are copied as raw bits: the kernels move 1-, 2-, 4- or 8-byte words and never do
arithmetic on them, so every dtype is copied exactly (bf16 included, whose arithmetic
the Triton interpreter gets wrong).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_util import check_launchable

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _check_index(idx: torch.Tensor, T: int) -> None:
    if idx.dim() != 1 or idx.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"idx must be a 1-D integer tensor, got {tuple(idx.shape)} {idx.dtype}")
    # Out-of-range indices would read or write outside the tensor on the GPU, so they
    # are refused here (one host sync) instead of trusted.
    if idx.numel() and not bool((idx.min() >= 0) & (idx.max() < T)):
        raise IndexError(f"idx values must lie in [0, {T})")


def gather_rows_reference(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Plain-torch gather. Same contract as :func:`gather_rows_triton`."""
    if src.dim() != 3:
        raise ValueError(f"src must be [H, T, D], got {tuple(src.shape)}")
    _check_index(idx, src.shape[1])
    return src.index_select(1, idx)


def scatter_rows_reference(dst: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Plain-torch scatter. Same contract as :func:`scatter_rows_triton`."""
    _check_scatter(dst, idx, rows)
    return dst.index_copy_(1, idx, rows)


def _check_scatter(dst: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> None:
    if dst.dim() != 3:
        raise ValueError(f"dst must be [H, T, D], got {tuple(dst.shape)}")
    _check_index(idx, dst.shape[1])
    expected = (dst.shape[0], idx.shape[0], dst.shape[2])
    if tuple(rows.shape) != expected:
        raise ValueError(f"rows must be [H, R, D] = {expected}, got {tuple(rows.shape)}")
    if rows.dtype != dst.dtype:
        raise ValueError(f"rows dtype {rows.dtype} != dst dtype {dst.dtype}")


@triton.jit
def _copy_rows_kernel(
    src_ptr, dst_ptr, idx_ptr,
    R, D,
    s_sh, s_st, s_sd,
    s_dh, s_dt, s_dd,
    GATHER: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program: BLOCK_R rows of one head. GATHER: dst[h, r] = src[h, idx[r]];
    # otherwise (scatter): dst[h, idx[r]] = src[h, r].
    h = tl.program_id(0)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    mask_r = offs_r < R
    row = tl.load(idx_ptr + offs_r, mask=mask_r, other=0).to(tl.int64)
    if GATHER:
        src_t = row
        dst_t = offs_r.to(tl.int64)
    else:
        src_t = offs_r.to(tl.int64)
        dst_t = row
    for start_d in range(0, D, BLOCK_D):
        offs_d = start_d + tl.arange(0, BLOCK_D)
        mask = mask_r[:, None] & (offs_d[None, :] < D)  # [BLOCK_R, BLOCK_D]
        vals = tl.load(src_ptr + h * s_sh + src_t[:, None] * s_st + offs_d[None, :] * s_sd, mask=mask)
        tl.store(dst_ptr + h * s_dh + dst_t[:, None] * s_dt + offs_d[None, :] * s_dd, vals, mask=mask)


def _launch(src: torch.Tensor, dst: torch.Tensor, idx: torch.Tensor, gather: bool) -> None:
    H, D = src.shape[0], src.shape[2]
    R = idx.shape[0]
    if not (H and R and D):
        return
    bits = _BITS[src.element_size()]
    src_b, dst_b = src.view(bits), dst.view(bits)
    block_r = 16
    grid = (H, triton.cdiv(R, block_r))
    _copy_rows_kernel[grid](
        src_b, dst_b, idx,
        R, D,
        *src_b.stride(), *dst_b.stride(),
        GATHER=gather,
        BLOCK_R=block_r, BLOCK_D=min(128, triton.next_power_of_2(D)),
    )


def gather_rows_triton(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` of ``src``: src [H, T, D] (any strides), idx [R] -> new [H, R, D].

    ``out[:, r] = src[:, idx[r]]``; idx may repeat and be in any order, values in [0, T).
    """
    if src.dim() != 3:
        raise ValueError(f"src must be [H, T, D], got {tuple(src.shape)}")
    _check_index(idx, src.shape[1])
    check_launchable(_copy_rows_kernel, src, idx)
    out = torch.empty((src.shape[0], idx.shape[0], src.shape[2]), dtype=src.dtype, device=src.device)
    _launch(src, out, idx, gather=True)
    return out


def scatter_rows_triton(dst: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Write ``rows`` [H, R, D] into ``dst`` [H, T, D] (any strides) at rows ``idx`` [R], in place.

    ``dst[:, idx[r]] = rows[:, r]``; idx values in [0, T) and distinct (with a repeated
    index, which of its rows lands is unspecified). Returns ``dst``.
    """
    _check_scatter(dst, idx, rows)
    check_launchable(_copy_rows_kernel, dst, idx, rows)
    _launch(rows, dst, idx, gather=False)
    return dst
