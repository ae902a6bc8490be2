"""kvkernels: Triton kernels of blended prefill, each beside its plain-torch reference.

The names without a suffix are dispatchers: the Triton kernel when the inputs are CUDA
tensors, the torch reference otherwise (CPU, CI); on CPU a prefill's attention is
torch's fused SDPA with a mask its caller builds once per set of rows
(`engine_adapter.llama.LlamaEngine.attend`: the reference materialises every score, the
Triton interpreter is slower still). ``*_triton`` and ``*_reference`` are the explicit
variants; tests run the Triton ones on CPU tensors under ``TRITON_INTERPRET=1``, which
must be set before this package is first imported.

Modules: ``rope`` (apply/remove RoPE at arbitrary positions), ``layer`` (a layer's fused
element-wise steps), ``attention`` (selective
attention with a position-causal mask and per-chunk attention mass)
and ``deviation`` (CacheBlend KV deviation + HKVD top-k).
"""

from __future__ import annotations

import torch

from .attention import (
    KeyReads,
    MASS_BLOCK_ROWS,
    attention_mass_blocked,
    attention_mass_reference,
    selective_attention_reference,
    selective_attention_triton,
)
from .deviation import (kv_deviation_reference, kv_deviation_topk_reference, kv_deviation_topk_triton,
                        kv_deviation_triton)
from .rope import (
    RopeConfig,
    apply_rope_reference,
    apply_rope_triton,
    inv_freq,
    rope_tables,
    rotate,
    rotate_reference,
    rotate_triton,
)

__all__ = [
    "KeyReads",
    "RopeConfig",
    "inv_freq",
    "rope_tables",
    "rotate",
    "rotate_triton",
    "rotate_reference",
    "apply_rope",
    "apply_rope_triton",
    "apply_rope_reference",
    "selective_attention",
    "selective_attention_triton",
    "selective_attention_reference",
    "attention_mass",
    "attention_mass_reference",
    "attention_mass_blocked",
    "kv_deviation",
    "kv_deviation_topk",
    "kv_deviation_topk_triton",
    "kv_deviation_topk_reference",
]


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cfg: RopeConfig,
    *,
    inverse: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate x [H, T, D] to per-token ``positions`` [T] (contract: :func:`apply_rope_triton`)."""
    if x.is_cuda:
        return apply_rope_triton(x, positions, cfg, inverse=inverse, out=out)
    return apply_rope_reference(x, positions, cfg, inverse=inverse, out=out)


def selective_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    scale: float | None = None,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Selected query rows over the merged cache, and per-segment mass
    (contract: :func:`selective_attention_triton`). On CPU a prefill wants torch's fused
    SDPA with a position mask (`LlamaEngine.attend`), the fast one there."""
    if q.is_cuda:
        return selective_attention_triton(q, q_pos, k, v, k_pos, scale=scale, segments=segments)
    return selective_attention_reference(q, q_pos, k, v, k_pos, scale=scale, segments=segments)


def attention_mass(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    k_pos: torch.Tensor,
    segments: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Per-segment attention mass fp32 [R, S] only (contract: :func:`attention_mass_reference`)."""
    if q.is_cuda:
        return selective_attention_triton(q, q_pos, k, k, k_pos, scale=scale, segments=segments)[1]
    if q.shape[1] >= 2 * MASS_BLOCK_ROWS and bool((k_pos[1:] >= k_pos[:-1]).all()):
        return attention_mass_blocked(q, q_pos, k, k_pos, segments, scale=scale)
    return attention_mass_reference(q, q_pos, k, k_pos, segments, scale=scale)


def kv_deviation(k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor) -> torch.Tensor:
    """Per-token KV deviation [T] (contract: :func:`kv_deviation_triton`), by the same
    implementation as `kv_deviation_topk` on the same tensors."""
    if k_new.is_cuda:
        return kv_deviation_triton(k_new, v_new, k_old, v_old)
    return kv_deviation_reference(k_new, v_new, k_old, v_old)


def kv_deviation_topk(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_old: torch.Tensor,
    v_old: torch.Tensor,
    ratio: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token KV deviation [T] and the HKVD token indices
    (contract: :func:`kv_deviation_topk_triton`)."""
    if k_new.is_cuda:
        return kv_deviation_topk_triton(k_new, v_new, k_old, v_old, ratio)
    return kv_deviation_topk_reference(k_new, v_new, k_old, v_old, ratio)

