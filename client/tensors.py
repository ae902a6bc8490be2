"""torch tensor <-> (TensorSpec, bytes), bit-exact for fp16 / bf16 / fp32.

The storable dtypes, their wire enums and sizes are the contract's (`kvcraft.layout.DTYPES`);
this module only maps each to its torch dtype.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np
import torch

from kvcraft.layout import BY_WIRE, DTYPES
from kvcraft.v1 import kvcraft_pb2 as pb

TORCH_DTYPE: dict[int, torch.dtype] = {d.wire: getattr(torch, d.name) for d in DTYPES}
"""Wire dtype enum -> torch dtype."""
_WIRE = {t: w for w, t in TORCH_DTYPE.items()}


def spec_of(t: torch.Tensor) -> pb.TensorSpec:
    if t.dtype not in _WIRE:
        raise ValueError(f"dtype {t.dtype} is not storable; use {', '.join(d.name for d in DTYPES)}")
    if t.dim() != 3:
        raise ValueError(f"expected a [kv_heads, tokens, head_dim] tensor, got shape {tuple(t.shape)}")
    return pb.TensorSpec(dtype=_WIRE[t.dtype], shape=list(t.shape))


def to_bytes(t: torch.Tensor) -> bytes:
    """Row-major bytes of a CPU copy of `t` (no dtype conversion)."""
    t = t.detach().to("cpu").contiguous()
    return t.view(torch.uint8).numpy().tobytes()


def byte_view(t: torch.Tensor) -> memoryview:
    """The row-major bytes of `t` as a view (no copy when `t` is a contiguous CPU
    tensor; a device tensor is copied to the host once). Keep `t` alive while it is used."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


def from_bytes(spec: pb.TensorSpec, data: bytes | memoryview, device: str | torch.device = "cpu") -> torch.Tensor:
    """A writable tensor of the bytes (one copy)."""
    if spec.dtype not in BY_WIRE:
        raise ValueError(f"unknown dtype {spec.dtype} in a LayerChunk")
    return _typed(torch.frombuffer(bytearray(data), dtype=torch.uint8), spec, device)


def from_message(spec: pb.TensorSpec, data: bytes | memoryview, device: str | torch.device = "cpu") -> torch.Tensor:
    """A tensor over `data` without a copy, for the bytes of a received message that
    nothing else holds (a FetchLayers LayerChunk): the tensor keeps the message alive
    and may be written (nobody else reads that buffer). Bytes not aligned for the dtype
    are copied once (typed loads need natural alignment)."""
    if spec.dtype not in BY_WIRE:
        raise ValueError(f"unknown dtype {spec.dtype} in a LayerChunk")
    n = len(data)
    if not n:  # reshaping nothing to the spec's shape raises, as for any wrong size
        return _typed(torch.empty(0, dtype=torch.uint8), spec, device)
    address = np.frombuffer(data, dtype=np.uint8).ctypes.data
    if address % BY_WIRE[spec.dtype].itemsize:
        return from_bytes(spec, data, device)  # misaligned: one copy
    # torch takes only writable buffers without a warning: a ctypes array over the same
    # memory, holding the message
    buf = (ctypes.c_ubyte * n).from_address(address)
    buf.message = data  # type: ignore[attr-defined]
    return _typed(torch.frombuffer(buf, dtype=torch.uint8), spec, device)


def message_tensors(message: bytes, parts: Sequence[tuple[pb.TensorSpec, int, int]],
                    device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """Tensors over byte ranges (spec, offset, nbytes) of one received message, as
    `from_message` makes them (no copy when aligned, one copy of a misaligned range;
    every tensor holds the message), with one buffer over the message for all ranges."""
    address = ctypes.cast(ctypes.c_char_p(message), ctypes.c_void_p).value or 0
    buf = None
    out = []
    for spec, offset, n in parts:
        wire = BY_WIRE.get(spec.dtype)
        if wire is None:
            raise ValueError(f"unknown dtype {spec.dtype} in a LayerChunk")
        if not n or (address + offset) % wire.itemsize or n % wire.itemsize:
            # empty, misaligned or not whole values: the general path (copy, or its error)
            out.append(from_message(spec, memoryview(message)[offset : offset + n], device))
            continue
        if buf is None:
            buf = (ctypes.c_ubyte * len(message)).from_address(address)
            buf.message = message  # type: ignore[attr-defined]
        t = torch.frombuffer(buf, dtype=TORCH_DTYPE[spec.dtype], count=n // wire.itemsize, offset=offset)
        t = t.view(tuple(spec.shape))
        out.append(t.to(device) if str(device) != "cpu" else t)
    return out


def _typed(flat: torch.Tensor, spec: pb.TensorSpec, device: str | torch.device) -> torch.Tensor:
    """The bytes `flat` as the spec's dtype and shape, on `device` (a copy only off the CPU)."""
    t = flat.view(TORCH_DTYPE[spec.dtype]).reshape(tuple(spec.shape))
    return t.to(device) if str(device) != "cpu" else t
