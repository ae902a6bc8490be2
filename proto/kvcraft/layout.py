"""Payload layout of a variant: dtypes, shapes, byte offsets, checksums.

A variant's payload is, for each layer in order, the row-major bytes of K then of V,
each of shape [kv_heads, tokens, head_dim] in the model dtype (docs/storage.md).
The service validates and checksums bytes with it; the client maps bytes to tensors
with it (the torch dtype of each name is the client's business: `kvclient.tensors`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import xxhash

from kvcraft.v1 import kvcraft_pb2 as pb


class LayoutError(ValueError):
    """A tensor spec that no payload can have; the message names the field and the problem."""


@dataclass(frozen=True)
class DType:
    """A storable element type: its name (as in `ModelSpec.dtype` and torch), wire enum, size."""

    name: str
    wire: int  # kvcraft.v1.DType value
    itemsize: int  # bytes per element


DTYPES: tuple[DType, ...] = (
    DType("float16", pb.FLOAT16, 2),
    DType("bfloat16", pb.BFLOAT16, 2),
    DType("float32", pb.FLOAT32, 4),
)
BY_WIRE: dict[int, DType] = {d.wire: d for d in DTYPES}
BY_NAME: dict[str, DType] = {d.name: d for d in DTYPES}


@dataclass(frozen=True)
class LayerLayout:
    """Byte sizes of one layer; the same for every layer of a variant."""

    key_bytes: int
    value_bytes: int

    @property
    def layer_bytes(self) -> int:
        return self.key_bytes + self.value_bytes

    def offset(self, layer: int) -> int:
        return layer * self.layer_bytes


def spec_bytes(spec: pb.TensorSpec, name: str, tokens: int) -> int:
    """Validate a K or V spec against the chunk's token count; return its byte size."""
    if spec.dtype not in BY_WIRE:
        shown = pb.DType.Name(spec.dtype) if spec.dtype in pb.DType.values() else spec.dtype
        names = [pb.DType.Name(d.wire) for d in DTYPES]
        expected = ", ".join(names[:-1]) + " or " + names[-1]
        raise LayoutError(f"{name}.dtype is {shown}; expected {expected}")
    shape = list(spec.shape)
    if len(shape) != 3 or min(shape) < 1:
        raise LayoutError(f"{name}.shape is {shape}; expected [kv_heads, tokens, head_dim], each >= 1")
    if shape[1] != tokens:
        raise LayoutError(f"{name}.shape[1] is {shape[1]} but the chunk has {tokens} tokens")
    return math.prod(shape) * BY_WIRE[spec.dtype].itemsize


def layer_layout(key_spec: pb.TensorSpec, value_spec: pb.TensorSpec, tokens: int) -> LayerLayout:
    kb = spec_bytes(key_spec, "key_spec", tokens)
    vb = spec_bytes(value_spec, "value_spec", tokens)
    if key_spec.shape[0] != value_spec.shape[0]:
        raise LayoutError(
            f"key_spec has {key_spec.shape[0]} kv heads but value_spec has {value_spec.shape[0]}"
        )
    return LayerLayout(kb, vb)


def layer_checksum(key: bytes | memoryview, value: bytes | memoryview) -> int:
    """xxh3-64 of K bytes followed by V bytes."""
    h = xxhash.xxh3_64()
    h.update(key)
    h.update(value)
    return h.intdigest()


STAGING_NAME_PREFIX = "kvcraft-stage-"
"""A co-located Store's staging area (StoreLocal) is a memfd named this + its staging
id; it holds the payload in the layout above (per layer K bytes then V bytes)."""
