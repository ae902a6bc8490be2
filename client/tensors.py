"""torch tensor <-> (TensorSpec, bytes), bit-exact for fp16 / bf16 / fp32."""

from __future__ import annotations

import torch

from kvcraft.v1 import kvcraft_pb2 as pb

_TO_PB = {torch.float16: pb.FLOAT16, torch.bfloat16: pb.BFLOAT16, torch.float32: pb.FLOAT32}
_FROM_PB = {v: k for k, v in _TO_PB.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def spec_of(t: torch.Tensor) -> pb.TensorSpec:
    if t.dtype not in _TO_PB:
        raise ValueError(f"dtype {t.dtype} is not storable; use float16, bfloat16 or float32")
    if t.dim() != 3:
        raise ValueError(f"expected a [kv_heads, tokens, head_dim] tensor, got shape {tuple(t.shape)}")
    return pb.TensorSpec(dtype=_TO_PB[t.dtype], shape=list(t.shape))


def to_bytes(t: torch.Tensor) -> bytes:
    """Row-major bytes of a CPU copy of `t` (no dtype conversion)."""
    t = t.detach().to("cpu").contiguous()
    return t.view(torch.uint8).numpy().tobytes()


def from_bytes(spec: pb.TensorSpec, data: bytes, device: str | torch.device = "cpu") -> torch.Tensor:
    if spec.dtype not in _FROM_PB:
        raise ValueError(f"unknown dtype {spec.dtype} in a LayerChunk")
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    t = flat.view(_FROM_PB[spec.dtype]).reshape(tuple(spec.shape))
    return t.to(device) if str(device) != "cpu" else t
