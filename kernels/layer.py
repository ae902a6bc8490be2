"""Fused element-wise steps of one Llama layer: what a GPU would otherwise run as many
small launches, each bound by the host rather than the device (docs/gpu.md).

- :func:`add_rms_norm`: the residual add of the attention output and the MLP's RMSNorm
  in one pass over the rows (torch: an add, a cast, a square, a mean, an rsqrt, two
  multiplies and casts: ~8 launches); :func:`rms_norm` without the add (a layer's input,
  the final norm).
- :func:`silu_mul`: SiLU of the gate times the up projection, read from the one fused
  [gate | up] matmul output (torch: a split, a SiLU, a multiply).
- :func:`rope_write`: the computed rows' q and k rotated to their positions and their
  K and V written into the layer's merged cache at their rows, from the one fused
  [q | k | v] matmul output (torch: a rotation of q and k, two index copies).

Each kernel has its plain-torch reference beside it, the arithmetic the reference
engine runs on CPU (`engine_adapter.llama.LlamaEngine`); the Triton kernels round where
the reference does, so they differ from it only by the order of a row's reduction
(RMSNorm's mean) and the device's transcendental functions (sigmoid).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._triton_util import check_launchable
from .rope import _rotate_halves, rotate_reference

# The stored K of a layer's merged cache before its rotation, with what rotates it: (raw
# [Hkv, N, D], cos [N, D/2], sin [N, D/2] fp32 at the keys' positions, computed [N] bool:
# the keys the rows write, which the rotation skips). `rope_write` rotates it into K.
Stored = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

# ---- residual add + RMSNorm ------------------------------------------------------------


def _check_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, launch: bool = False) -> None:
    """Rows [..., R, d] for the reference (a batch of prompts), [R, d] for a launch."""
    if h.dim() < 2 or (launch and h.dim() != 2) or h.shape != delta.shape or weight.shape != (h.shape[-1],):
        raise ValueError(f"h and delta must be one [R, d] shape and weight [d], got {tuple(h.shape)}, "
                         f"{tuple(delta.shape)}, {tuple(weight.shape)}")
    if not (h.dtype == delta.dtype == weight.dtype):
        raise ValueError(f"h, delta and weight must share a dtype, got {h.dtype}, {delta.dtype}, {weight.dtype}")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm as transformers computes it: fp32 statistics, the normalised row
    rounded to x's dtype before the weight multiplies it."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, RMSNorm(h + delta) * weight) for rows h, delta [R, d]; see :func:`add_rms_norm`."""
    _check_norm(h, delta, weight)
    s = h + delta
    return s, rms_norm_reference(s, weight, eps)


@triton.jit
def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, s_ptr, y_ptr, N, eps,
                         stride_h, stride_d, stride_s, stride_y, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    # One program: one row, all of its N features (a hidden size fits one block).
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    h = tl.load(h_ptr + r * stride_h + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + r * stride_d + offs, mask=mask, other=0.0).to(tl.float32)
        s = (h.to(tl.float32) + d).to(s_ptr.dtype.element_ty)  # the residual stream, rounded as torch's add
        tl.store(s_ptr + r * stride_s + offs, s, mask=mask)
    else:
        s = h
    sf = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    normed = (sf * inv).to(y_ptr.dtype.element_ty).to(tl.float32)  # rounded before the weight, as the reference
    tl.store(y_ptr + r * stride_y + offs, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_triton(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm` as one Triton launch (one program per row)."""
    _check_norm(h, delta, weight, launch=True)
    if h.stride(1) != 1 or delta.stride(1) != 1:
        h, delta = h.contiguous(), delta.contiguous()
    check_launchable(_add_rms_norm_kernel, h, delta, weight)
    R, N = h.shape
    s, y = torch.empty_like(h), torch.empty_like(h)
    if R == 0:
        return s, y
    _add_rms_norm_kernel[(R,)](h, delta, weight.contiguous(), s, y, N, eps,
                               h.stride(0), delta.stride(0), s.stride(0), y.stride(0),
                               HAS_DELTA=True, BLOCK=triton.next_power_of_2(N))
    return s, y


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm_reference` as one Triton launch (one program per row of x [R, d])."""
    _check_norm(x, x, weight, launch=True)
    if x.stride(1) != 1:
        x = x.contiguous()
    check_launchable(_add_rms_norm_kernel, x, weight)
    R, N = x.shape
    y = torch.empty_like(x)
    if R:
        _add_rms_norm_kernel[(R,)](x, x, weight.contiguous(), x, y, N, eps, x.stride(0), x.stride(0), x.stride(0),
                                   y.stride(0), HAS_DELTA=False, BLOCK=triton.next_power_of_2(N))
    return y


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after a sublayer, s = h + delta, and the next sublayer's input,
    RMSNorm(s) * weight, for rows h, delta [R, d] and weight [d] of one dtype.

    CUDA tensors: one Triton launch; otherwise the plain-torch reference."""
    if h.is_cuda:
        return add_rms_norm_triton(h, delta, weight, eps)
    return add_rms_norm_reference(h, delta, weight, eps)


# ---- SiLU(gate) * up -------------------------------------------------------------------


def _check_gate_up(gate_up: torch.Tensor, launch: bool = False) -> None:
    """[..., R, 2I] for the reference (a batch of prompts), [R, 2I] for a launch."""
    if gate_up.dim() < 2 or (launch and gate_up.dim() != 2) or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [R, 2I] (gate, then up), got {tuple(gate_up.shape)}")


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up [R, I] from gate_up [R, 2I] (gate first); see :func:`silu_mul`."""
    _check_gate_up(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, R, INTER, stride_x, stride_o,
                     BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (offs_r < R)[:, None] & (offs_i < INTER)[None, :]
    base = x_ptr + offs_r[:, None] * stride_x + offs_i[None, :]
    gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + INTER, mask=mask, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as torch's silu
    tl.store(out_ptr + offs_r[:, None] * stride_o + offs_i[None, :], (act * up).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_mul` as one Triton launch."""
    _check_gate_up(gate_up, launch=True)
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    check_launchable(_silu_mul_kernel, gate_up)
    R, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(R, inter, dtype=gate_up.dtype, device=gate_up.device)
    if R == 0 or inter == 0:
        return out
    block_r, block_i = 16, 128
    _silu_mul_kernel[(triton.cdiv(R, block_r), triton.cdiv(inter, block_i))](
        gate_up, out, R, inter, gate_up.stride(0), out.stride(0), BLOCK_R=block_r, BLOCK_I=block_i)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Llama's MLP activation, SiLU(gate) * up [R, I], from the fused gate/up projection
    gate_up [R, 2I] (gate in the first half). CUDA: one Triton launch; else torch."""
    if gate_up.is_cuda:
        return silu_mul_triton(gate_up)
    return silu_mul_reference(gate_up)


# ---- rotate q and k, write K and V into the layer's cache -------------------------------


def _check_rope_write(qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
                      K: torch.Tensor, V: torch.Tensor, stored: "Stored | None" = None) -> None:
    H, R, D = qkv.shape
    hkv = K.shape[0]
    if K.dim() != 3 or K.shape != V.shape or heads + 2 * hkv != H or K.shape[2] != D:
        raise ValueError(f"qkv must be [heads + 2 Hkv, R, D] with K, V [Hkv, N, D]: got qkv {tuple(qkv.shape)}, "
                         f"heads {heads}, K {tuple(K.shape)}, V {tuple(V.shape)}")
    if cos.shape != (R, D // 2) or sin.shape != (R, D // 2) or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos and sin must be fp32 [R={R}, D/2={D // 2}] (rope_tables at the rows), "
                         f"got {tuple(cos.shape)} {cos.dtype}, {tuple(sin.shape)} {sin.dtype}")
    if rows.shape != (R,) or rows.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"rows must be integer [R={R}], got {tuple(rows.shape)} {rows.dtype}")
    if not (qkv.dtype == K.dtype == V.dtype):
        raise ValueError(f"qkv, K and V must share a dtype, got {qkv.dtype}, {K.dtype}, {V.dtype}")
    if stored is not None:
        raw, raw_cos, raw_sin, computed = stored
        N = K.shape[1]
        if raw.shape != K.shape or raw.dtype != K.dtype or raw.data_ptr() == K.data_ptr():
            raise ValueError(f"stored K must be [Hkv, N, D] {tuple(K.shape)} in K's dtype, apart from K: "
                             f"got {tuple(raw.shape)} {raw.dtype}")
        if raw_cos.shape != (N, D // 2) or raw_sin.shape != (N, D // 2) or raw_cos.dtype != torch.float32:
            raise ValueError(f"the stored K's cos and sin must be fp32 [N={N}, D/2={D // 2}], "
                             f"got {tuple(raw_cos.shape)} {raw_cos.dtype}, {tuple(raw_sin.shape)}")
        if computed.shape != (N,) or computed.dtype != torch.bool:
            raise ValueError(f"computed must be bool [N={N}], got {tuple(computed.shape)} {computed.dtype}")


def rope_write_reference(qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
                         K: torch.Tensor, V: torch.Tensor, stored: "Stored | None" = None) -> torch.Tensor:
    """:func:`rope_write` in plain torch: the stored K's rotation into K (where given), a
    rotation of q and k, two index copies."""
    _check_rope_write(qkv, heads, cos, sin, rows, K, V, stored)
    if stored is not None:
        K.copy_(rotate_reference(stored[0], stored[1], stored[2]))
    hkv = K.shape[0]
    qk = rotate_reference(qkv[:heads + hkv], cos, sin)
    K.index_copy_(1, rows, qk[heads:])
    V.index_copy_(1, rows, qkv[heads + hkv:])
    return qk[:heads]


@triton.jit
def _rope_write_kernel(
    x_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, rows_ptr,
    raw_ptr, raw_cos_ptr, raw_sin_ptr, computed_ptr,
    R, N, HALF, HEADS, HKV,
    stride_xh, stride_xt, stride_xd,
    stride_qh, stride_qt, stride_qd,
    stride_kh, stride_kt, stride_kd,
    stride_vh, stride_vt, stride_vd,
    stride_rh, stride_rt, stride_rd,
    stride_c, stride_s, stride_rc, stride_rs,
    BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # One program: one of the heads + 2 Hkv heads of qkv, BLOCK_T rows. Query heads go to
    # q (rotated, in row order), key heads to K at the rows' cache rows (rotated), value
    # heads to V at the same rows (as they are). With the stored K (`raw`), Hkv programs
    # more per block: one head of it, BLOCK_T keys, rotated into K at every key no row
    # writes (so no two programs write one place, and the rows' K is what K holds there).
    h = tl.program_id(0)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_HALF)
    if h >= HEADS + 2 * HKV:
        mask_n = offs_t < N
        keep = tl.load(computed_ptr + offs_t, mask=mask_n, other=1) == 0
        mask = (mask_n & keep)[:, None] & (offs_d[None, :] < HALF)
        cos = tl.load(raw_cos_ptr + offs_t[:, None] * stride_rc + offs_d[None, :], mask=mask, other=0.0)
        sin = tl.load(raw_sin_ptr + offs_t[:, None] * stride_rs + offs_d[None, :], mask=mask, other=0.0)
        kh = h - HEADS - 2 * HKV
        _rotate_halves(raw_ptr + kh * stride_rh, k_ptr + kh * stride_kh, offs_t, offs_d, mask, cos, sin, HALF,
                       stride_rt, stride_rd, stride_kt, stride_kd)
    else:
        mask_t = offs_t < R
        mask = mask_t[:, None] & (offs_d[None, :] < HALF)
        src = x_ptr + h * stride_xh + offs_t[:, None] * stride_xt + offs_d[None, :] * stride_xd
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF * stride_xd, mask=mask, other=0.0).to(tl.float32)
        if h < HEADS + HKV:
            cos = tl.load(cos_ptr + offs_t[:, None] * stride_c + offs_d[None, :], mask=mask, other=0.0)
            sin = tl.load(sin_ptr + offs_t[:, None] * stride_s + offs_d[None, :], mask=mask, other=0.0)
            y1 = x1 * cos - x2 * sin
            y2 = x2 * cos + x1 * sin
            if h < HEADS:
                dst = q_ptr + h * stride_qh + offs_t[:, None] * stride_qt + offs_d[None, :] * stride_qd
                step = HALF * stride_qd
            else:
                at = tl.load(rows_ptr + offs_t, mask=mask_t, other=0)
                dst = k_ptr + (h - HEADS) * stride_kh + at[:, None] * stride_kt + offs_d[None, :] * stride_kd
                step = HALF * stride_kd
        else:
            y1, y2 = x1, x2
            at = tl.load(rows_ptr + offs_t, mask=mask_t, other=0)
            dst = v_ptr + (h - HEADS - HKV) * stride_vh + at[:, None] * stride_vt + offs_d[None, :] * stride_vd
            step = HALF * stride_vd
        tl.store(dst, y1.to(k_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + step, y2.to(k_ptr.dtype.element_ty), mask=mask)


def rope_write_triton(qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
                      K: torch.Tensor, V: torch.Tensor, stored: Stored | None = None) -> torch.Tensor:
    """:func:`rope_write` as one Triton launch (the stored K's rotation in it too); equals the
    reference bit for bit (no fused multiply-adds)."""
    _check_rope_write(qkv, heads, cos, sin, rows, K, V, stored)
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    if stored is None:  # no program of the stored K runs: any tensors stand in for it
        raw, raw_cos, raw_sin, computed, n = K, cos, sin, rows, 0
    else:
        raw, raw_cos, raw_sin, computed = stored
        raw_cos = raw_cos if raw_cos.stride(-1) == 1 else raw_cos.contiguous()
        raw_sin = raw_sin if raw_sin.stride(-1) == 1 else raw_sin.contiguous()
        n = K.shape[1]
    check_launchable(_rope_write_kernel, qkv, cos, sin, rows, K, V, raw, raw_cos, raw_sin, computed)
    H, R, D = qkv.shape
    hkv = K.shape[0]
    q = torch.empty(heads, R, D, dtype=qkv.dtype, device=qkv.device)
    if max(R, n) == 0:
        return q
    block_t = 16
    _rope_write_kernel[(H + (hkv if n else 0), triton.cdiv(max(R, n), block_t))](
        qkv, q, K, V, cos, sin, rows,
        raw, raw_cos, raw_sin, computed,
        R, n, D // 2, heads, hkv,
        qkv.stride(0), qkv.stride(1), qkv.stride(2),
        q.stride(0), q.stride(1), q.stride(2),
        K.stride(0), K.stride(1), K.stride(2),
        V.stride(0), V.stride(1), V.stride(2),
        raw.stride(0), raw.stride(1), raw.stride(2),
        cos.stride(0), sin.stride(0), raw_cos.stride(0), raw_sin.stride(0),
        BLOCK_T=block_t, BLOCK_HALF=triton.next_power_of_2(D // 2),
        enable_fp_fusion=False,  # a fused multiply-add would round differently from the reference
    )
    return q


def rope_write(qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
               K: torch.Tensor, V: torch.Tensor, stored: Stored | None = None) -> torch.Tensor:
    """The computed rows' attention inputs in one step (Cache-Craft §3.4.3: the computed
    rows' K/V replace the stored ones in the merged cache, RoPE at their positions).

    qkv [heads + 2 Hkv, R, D]: the rows' pre-RoPE q, k and v heads (`LlamaEngine.qkv`'s
    one matmul); cos, sin fp32 [R, D/2]: `rope_tables` at the rows' positions; rows [R]:
    their rows in the layer's cache K, V [Hkv, N, D] (K post-RoPE). Writes the rotated k
    into K and v into V at `rows`; returns the rotated q [heads, R, D]. `stored` (`Stored`):
    the layer's stored K, RoPE-free (Cache-Craft §3.4.1), rotated to the keys' positions into
    K first, in the same launch: the merge's rotation and the rows' write as one.
    CUDA: one Triton launch; else torch."""
    if qkv.is_cuda:
        return rope_write_triton(qkv, heads, cos, sin, rows, K, V, stored)
    return rope_write_reference(qkv, heads, cos, sin, rows, K, V, stored)
