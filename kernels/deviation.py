"""Per-token KV deviation and the top-ratio HKVD tokens (CacheBlend §4).

CacheBlend §4.1 defines the KV deviation of token j on layer i as "the absolute
difference between KV_i[j] and KV_i^full[j]", i.e. between the cached KV and the KV a
full prefill would produce; §4.3 picks the High-KV-Deviation (HKVD) tokens, the r%
with the largest deviation, and recomputes only those (Insight 1), with gradual
filtering across layers (Insight 2: r1 > r2 > ... on the previous layer's HKVD set).

A token's KV is a set of vectors (every head's K and V), so "absolute difference" is
taken here as the L1 norm of the difference over all of them:

    deviation[j] = sum_h sum_d |K_new[h, j, d] - K_old[h, j, d]| + |V_new[h, j, d] - V_old[h, j, d]|

computed in fp32. The caller decides which tokens to pass (all on layer 1, the previous
HKVD set afterwards) and maps the returned indices back to its own token ids.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._triton_util import check_launchable


def _check(k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor, ratio: float) -> None:
    if k_new.dim() != 3:
        raise ValueError(f"KV must be [H, T, D], got shape {tuple(k_new.shape)}")
    for name, t in (("v_new", v_new), ("k_old", k_old), ("v_old", v_old)):
        if t.shape != k_new.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != k_new shape {tuple(k_new.shape)}")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")


def num_selected(ratio: float, T: int) -> int:
    """ceil(ratio * T), robust to float noise (0.1 * 30 is 3.0000000000000004 in binary)."""
    return min(T, math.ceil(round(ratio * T, 9)))


def _top(deviation: torch.Tensor, ratio: float) -> torch.Tensor:
    n = num_selected(ratio, deviation.shape[0])
    # A stable descending sort breaks ties by the lower token index, so the choice is
    # deterministic and identical for both implementations given equal deviations.
    order = torch.sort(deviation, descending=True, stable=True).indices[:n]
    return order.sort().values


def kv_deviation_reference(k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor,
                           v_old: torch.Tensor) -> torch.Tensor:
    """Plain-torch KV deviation. Same contract as :func:`kv_deviation_triton`."""
    _check(k_new, v_new, k_old, v_old, 0.0)
    # CacheBlend §4.1: absolute difference of the token's KV, summed over heads and dims.
    return (k_new.float() - k_old.float()).abs().sum(dim=(0, 2)) + (v_new.float() - v_old.float()).abs().sum(
        dim=(0, 2)
    )  # [T]


def kv_deviation_topk_reference(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_old: torch.Tensor,
    v_old: torch.Tensor,
    ratio: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch KV deviation + top-k. Same contract as :func:`kv_deviation_topk_triton`."""
    _check(k_new, v_new, k_old, v_old, ratio)
    dev = kv_deviation_reference(k_new, v_new, k_old, v_old)
    return dev, _top(dev, ratio)


@triton.jit
def _deviation_kernel(
    kn_ptr, vn_ptr, ko_ptr, vo_ptr, dev_ptr,
    H, T, D,
    s_knh, s_knt, s_knd,
    s_vnh, s_vnt, s_vnd,
    s_koh, s_kot, s_kod,
    s_voh, s_vot, s_vod,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program: BLOCK_T tokens, summing over every head and the head dim, so each
    # token's deviation is written once, with no atomics and a fixed summation order.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    mask_t = offs_t < T
    total = tl.zeros([BLOCK_T], dtype=tl.float32)
    for h in range(0, H):
        for start_d in range(0, D, BLOCK_D):
            offs_d = start_d + tl.arange(0, BLOCK_D)  # [BLOCK_D]
            mask = mask_t[:, None] & (offs_d[None, :] < D)  # [BLOCK_T, BLOCK_D]
            kn = tl.load(kn_ptr + h * s_knh + offs_t[:, None] * s_knt + offs_d[None, :] * s_knd, mask=mask, other=0.0)
            ko = tl.load(ko_ptr + h * s_koh + offs_t[:, None] * s_kot + offs_d[None, :] * s_kod, mask=mask, other=0.0)
            vn = tl.load(vn_ptr + h * s_vnh + offs_t[:, None] * s_vnt + offs_d[None, :] * s_vnd, mask=mask, other=0.0)
            vo = tl.load(vo_ptr + h * s_voh + offs_t[:, None] * s_vot + offs_d[None, :] * s_vod, mask=mask, other=0.0)
            diff = tl.abs(kn.to(tl.float32) - ko.to(tl.float32)) + tl.abs(vn.to(tl.float32) - vo.to(tl.float32))
            total += tl.sum(diff, axis=1)
    tl.store(dev_ptr + offs_t, total, mask=mask_t)


def kv_deviation_topk_triton(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_old: torch.Tensor,
    v_old: torch.Tensor,
    ratio: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KV deviation of every token and the HKVD tokens (Triton deviation, torch sort).

    Args:
        k_new, v_new: [H, T, D] recomputed K and V of the T candidate tokens.
        k_old, v_old: [H, T, D] cached K and V of the same tokens (K at the same
            positions as k_new, i.e. after RoPE re-application).
        ratio: fraction of tokens to select, in [0, 1].

    Returns:
        deviation: fp32 [T], sum over heads and dims of |K_new - K_old| + |V_new - V_old|.
        indices: int64 [ceil(ratio * T)], the tokens of largest deviation (ties to the
            lower index), sorted ascending.
    """
    _check(k_new, v_new, k_old, v_old, ratio)
    dev = kv_deviation_triton(k_new, v_new, k_old, v_old)
    return dev, _top(dev, ratio)


def kv_deviation_triton(k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor,
                        v_old: torch.Tensor) -> torch.Tensor:
    """fp32 [T]: every token's sum over heads and dims of |K_new - K_old| + |V_new - V_old|
    (inputs [H, T, D] as :func:`kv_deviation_topk_triton`'s), one launch: no read of the
    device, so a CUDA graph can hold it."""
    _check(k_new, v_new, k_old, v_old, 0.0)
    check_launchable(_deviation_kernel, k_new, v_new, k_old, v_old)
    H, T, D = k_new.shape
    dev = torch.zeros(T, dtype=torch.float32, device=k_new.device)
    if T and H and D:
        block_t = 16
        _deviation_kernel[(triton.cdiv(T, block_t),)](
            k_new, v_new, k_old, v_old, dev,
            H, T, D,
            *k_new.stride(), *v_new.stride(), *k_old.stride(), *v_old.stride(),
            BLOCK_T=block_t, BLOCK_D=min(128, triton.next_power_of_2(D)),
        )
    return dev
