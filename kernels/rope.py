"""Rotary position embedding (RoPE), applied and removed at arbitrary per-token positions.

Cache-Craft §3.4.3 stores chunk K without RoPE and applies the new positions at reuse
time, after the cached and recomputed KV are merged; CacheBlend §4 (footnote 3) does
the same correction by a rotation of the cached K. Both need one operation:
rotate each token of ``x`` by the angle of *its* position. Removing RoPE is the same
rotation by the negative angle. Angles are always ``position * inv_freq`` computed in
fp32 from the absolute position, never composed from a "delta" rotation, so moving a
chunk twice does not accumulate error.

Convention: Hugging Face Llama "rotate half" (the first and second halves of the head
dimension form the pairs), i.e. ``x * cos + rotate_half(x) * sin`` with
``rotate_half(x) = cat(-x2, x1)``; Llama-3 frequency scaling ("llama3" rope_type).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from ._triton_util import check_launchable


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters of one model.

    ``factor`` is None for plain RoPE; set, it enables Llama-3 scaling with
    ``low_freq_factor``, ``high_freq_factor`` and ``original_max_position_embeddings``.
    """

    head_dim: int
    theta: float = 10000.0
    factor: float | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be positive and even, got {self.head_dim}")
        if self.theta <= 0:
            raise ValueError(f"theta must be positive, got {self.theta}")
        if self.factor is not None:
            if self.factor <= 0:
                raise ValueError(f"factor must be positive, got {self.factor}")
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError("high_freq_factor must exceed low_freq_factor")
            if self.original_max_position_embeddings <= 0:
                raise ValueError("original_max_position_embeddings must be positive")

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> RopeConfig:
        """Read a Hugging Face Llama ``config.json`` (as a dict).

        Accepts both layouts: ``rope_theta`` + ``rope_scaling`` (transformers 4) and
        ``rope_parameters`` holding ``rope_theta`` and the scaling keys (transformers 5).
        A transformers config object is read through its ``to_dict()``. Only the
        "default" and "llama3" rope types are supported; others raise ValueError.
        """
        if not isinstance(config, Mapping) and hasattr(config, "to_dict"):
            config = config.to_dict()
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        params: dict[str, Any] = {}
        for key in ("rope_scaling", "rope_parameters"):
            if config.get(key):
                params.update(config[key])
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        if rope_type == "default":
            return cls(head_dim=int(head_dim), theta=float(theta))
        if rope_type == "llama3":
            return cls(
                head_dim=int(head_dim),
                theta=float(theta),
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            )
        raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, llama3)")


def inv_freq(cfg: RopeConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies, fp32 [head_dim // 2], computed the way transformers does.

    The same fp32 arithmetic as transformers' default and llama3 initialisers, so a
    cache written by an HF model and rotated here agree bit for bit in the angles.
    The tensor is cached per (cfg, device) and shared: do not modify it in place.
    """
    return _inv_freq_cached(cfg, str(torch.device(device or "cpu")))


@functools.lru_cache(maxsize=64)
def _inv_freq_cached(cfg: RopeConfig, device: str) -> torch.Tensor:
    dim = cfg.head_dim
    freq = 1.0 / (cfg.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [D/2]
    if cfg.factor is not None:
        # Llama 3.1 scaling: long wavelengths divided by factor, short ones kept,
        # the band between interpolated smoothly.
        low_freq_wavelen = cfg.original_max_position_embeddings / cfg.low_freq_factor
        high_freq_wavelen = cfg.original_max_position_embeddings / cfg.high_freq_factor
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_freq_wavelen, freq / cfg.factor, freq)
        smooth = (cfg.original_max_position_embeddings / wavelen - cfg.low_freq_factor) / (
            cfg.high_freq_factor - cfg.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        freq = torch.where(medium, smoothed, scaled)
    return freq.to(device)


def _check(x: torch.Tensor, positions: torch.Tensor, cfg: RopeConfig, out: torch.Tensor | None) -> None:
    if x.dim() != 3:
        raise ValueError(f"x must be [H, T, D], got shape {tuple(x.shape)}")
    if x.shape[-1] != cfg.head_dim:
        raise ValueError(f"x head dim {x.shape[-1]} != cfg.head_dim {cfg.head_dim}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    if positions.dim() != 1 or positions.shape[0] != x.shape[1]:
        raise ValueError(f"positions must be [T={x.shape[1]}], got {tuple(positions.shape)}")
    if positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"positions must be an integer tensor, got {positions.dtype}")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device):
        raise ValueError("out must match x in shape, dtype and device")


def rope_tables(cfg: RopeConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin [T, D/2] of ``positions`` [T]: compute once, rotate many tensors
    (every layer of a prefill uses the same positions) with :func:`rotate`."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq(cfg, positions.device)[None, :]  # [T, D/2]
    return freqs.cos(), freqs.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [H, T, D] rotated by tables from :func:`rope_tables` (rows of x = rows of the tables).

    CUDA tensors: one Triton launch (:func:`rotate_triton`); otherwise plain torch
    (:func:`rotate_reference`). The same arithmetic either way, bit for bit.
    """
    if x.is_cuda and x.dim() == 3:
        return rotate_triton(x, cos, sin)
    return rotate_reference(x, cos, sin)


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`rotate` in plain torch: the arithmetic of :func:`apply_rope_reference` (fp32,
    rounded once to x.dtype); batched: one call rotates all heads and tokens."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]  # [H, T, D/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


@triton.jit
def _rotate_halves(x_head, out_head, offs_t, offs_d, mask, cos, sin, HALF,
                   stride_xt, stride_xd, stride_ot, stride_od):
    # One head's [BLOCK_T, BLOCK_HALF] pairs: x1 (first half), x2 (second) -> x1 cos - x2 sin,
    # x2 cos + x1 sin, in fp32, rounded once to out's dtype. Both halves are read before
    # anything is written, so out may alias x (in place).
    x_base = x_head + offs_t[:, None] * stride_xt + offs_d[None, :] * stride_xd
    x1 = tl.load(x_base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + HALF * stride_xd, mask=mask, other=0.0).to(tl.float32)
    o_base = out_head + offs_t[:, None] * stride_ot + offs_d[None, :] * stride_od
    tl.store(o_base, (x1 * cos - x2 * sin).to(out_head.dtype.element_ty), mask=mask)
    tl.store(o_base + HALF * stride_od, (x2 * cos + x1 * sin).to(out_head.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_kernel(
    x_ptr, out_ptr, cos_ptr, sin_ptr,
    T, HALF,
    stride_xh, stride_xt, stride_xd,
    stride_oh, stride_ot, stride_od,
    stride_ct, stride_st,
    BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # One program: one head, BLOCK_T tokens, all of the head dim; the tables' rows are the tokens'.
    h = tl.program_id(0)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    offs_d = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    mask = (offs_t < T)[:, None] & (offs_d[None, :] < HALF)  # [BLOCK_T, BLOCK_HALF]
    cos = tl.load(cos_ptr + offs_t[:, None] * stride_ct + offs_d[None, :], mask=mask, other=0.0)
    sin = tl.load(sin_ptr + offs_t[:, None] * stride_st + offs_d[None, :], mask=mask, other=0.0)
    _rotate_halves(x_ptr + h * stride_xh, out_ptr + h * stride_oh, offs_t, offs_d, mask, cos, sin, HALF,
                   stride_xt, stride_xd, stride_ot, stride_od)


def rotate_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`rotate` as one Triton launch: x [H, T, D] (any strides), fp32 tables [T, D/2];
    into `out` (x's shape and dtype, not x itself) where given.

    The blend loop rotates twice a layer (the merged cache; the computed rows' Q and K as
    one tensor); in plain torch each rotation is ~10 small CUDA launches, which bound a
    prefill on a GPU (docs/gpu.md). Multiply-adds are not fused, so the result equals
    :func:`rotate_reference` bit for bit.
    """
    H, T, D = x.shape
    half = D // 2
    if cos.shape != (T, half) or sin.shape != (T, half):
        raise ValueError(f"cos and sin must be [T={T}, D/2={half}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos and sin must be fp32 (rope_tables), got {cos.dtype}, {sin.dtype}")
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    elif out.shape != x.shape or out.dtype != x.dtype or out.data_ptr() == x.data_ptr():
        raise ValueError(f"out must be a tensor apart from x of its shape {tuple(x.shape)} and dtype {x.dtype}")
    check_launchable(_rotate_kernel, x, cos, sin, out)
    if T == 0 or H == 0:
        return out
    block_t = 16
    _rotate_kernel[(H, triton.cdiv(T, block_t))](
        x, out, cos, sin,
        T, half,
        x.stride(0), x.stride(1), x.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        cos.stride(0), sin.stride(0),
        BLOCK_T=block_t, BLOCK_HALF=triton.next_power_of_2(half),
        enable_fp_fusion=False,  # a fused multiply-add would round differently from the reference
    )
    return out


def apply_rope_reference(
    x: torch.Tensor,
    positions: torch.Tensor,
    cfg: RopeConfig,
    *,
    inverse: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch RoPE. Same contract as :func:`apply_rope_triton`."""
    _check(x, positions, cfg, out)
    cos, sin = rope_tables(cfg, positions.to(x.device))
    if inverse:
        sin = -sin  # rotation by -angle is the exact inverse rotation
    rotated = rotate_reference(x, cos, sin)
    if out is None:
        return rotated
    out.copy_(rotated)
    return out


@triton.jit
def _rope_kernel(
    x_ptr, out_ptr, pos_ptr, freq_ptr,
    T, HALF,
    stride_xh, stride_xt, stride_xd,
    stride_oh, stride_ot, stride_od,
    SIGN: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # One program: one head, BLOCK_T tokens, all of the head dim.
    h = tl.program_id(0)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    offs_d = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    mask_t = offs_t < T
    mask = mask_t[:, None] & (offs_d[None, :] < HALF)  # [BLOCK_T, BLOCK_HALF]

    pos = tl.load(pos_ptr + offs_t, mask=mask_t, other=0).to(tl.float32)
    freq = tl.load(freq_ptr + offs_d, mask=offs_d < HALF, other=0.0)
    angle = pos[:, None] * freq[None, :]  # [BLOCK_T, BLOCK_HALF], fp32 like transformers
    cos = tl.cos(angle)
    sin = tl.sin(angle) * SIGN

    _rotate_halves(x_ptr + h * stride_xh, out_ptr + h * stride_oh, offs_t, offs_d, mask, cos, sin, HALF,
                   stride_xt, stride_xd, stride_ot, stride_od)


def apply_rope_triton(
    x: torch.Tensor,
    positions: torch.Tensor,
    cfg: RopeConfig,
    *,
    inverse: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate every token of ``x`` [H, T, D] to its own position (Triton).

    ``positions`` [T] integer, one absolute position per token, any order.
    ``inverse=True`` rotates by the negative angle, which removes RoPE applied at the
    same positions. Angles are ``positions * inv_freq(cfg)`` in fp32; the rotation runs
    in fp32 and rounds once to ``x.dtype``. Returns ``out`` (a new tensor when None);
    ``out=x`` rotates in place. fp16, bf16 and fp32 inputs.
    """
    _check(x, positions, cfg, out)
    if out is None:
        out = torch.empty_like(x)
    check_launchable(_rope_kernel, x, positions, out)
    H, T, D = x.shape
    if T == 0 or H == 0:
        return out
    half = D // 2
    freq = inv_freq(cfg, x.device)
    block_t = 16
    grid = (H, triton.cdiv(T, block_t))
    _rope_kernel[grid](
        x, out, positions, freq,
        T, half,
        x.stride(0), x.stride(1), x.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        SIGN=-1.0 if inverse else 1.0,
        BLOCK_T=block_t, BLOCK_HALF=triton.next_power_of_2(half),
    )
    return out
