"""Payload layout (kvcraft.layout): sizes, offsets and checksums both sides compute alike."""

from __future__ import annotations

import math

import pytest
import xxhash

from kvcraft import tiers
from kvcraft.layout import BY_NAME, BY_WIRE, DTYPES, LayoutError, layer_checksum, layer_layout, spec_bytes
from kvcraft.v1 import kvcraft_pb2 as pb


def spec(dtype: int, *shape: int) -> pb.TensorSpec:
    return pb.TensorSpec(dtype=dtype, shape=list(shape))


def test_every_wire_dtype_but_unspecified_is_storable_once():
    wire = [v for v in pb.DType.values() if v != pb.DType.Value("DTYPE_UNSPECIFIED")]
    assert sorted(BY_WIRE) == sorted(wire)
    assert [BY_NAME[d.name] for d in DTYPES] == list(DTYPES)
    assert {d.name: d.itemsize for d in DTYPES} == {"float16": 2, "bfloat16": 2, "float32": 4}


def test_layer_layout_sizes_and_offsets():
    k, v = spec(pb.BFLOAT16, 8, 17, 128), spec(pb.FLOAT32, 8, 17, 64)
    lay = layer_layout(k, v, tokens=17)
    assert lay.key_bytes == 8 * 17 * 128 * 2
    assert lay.value_bytes == 8 * 17 * 64 * 4
    assert [lay.offset(i) for i in range(3)] == [0, lay.layer_bytes, 2 * lay.layer_bytes]
    assert spec_bytes(k, "key_spec", 17) == math.prod(k.shape) * 2


@pytest.mark.parametrize(("key", "value", "message"), [
    (spec(99, 1, 4, 2), spec(pb.FLOAT16, 1, 4, 2), "key_spec.dtype is 99; expected FLOAT16, BFLOAT16 or FLOAT32"),
    (spec(pb.FLOAT16, 1, 4), spec(pb.FLOAT16, 1, 4, 2), r"key_spec.shape is \[1, 4\]"),
    (spec(pb.FLOAT16, 1, 4, 0), spec(pb.FLOAT16, 1, 4, 2), "each >= 1"),
    (spec(pb.FLOAT16, 1, 4, 2), spec(pb.FLOAT16, 1, 5, 2), r"value_spec.shape\[1\] is 5 but the chunk has 4 tokens"),
    (spec(pb.FLOAT16, 1, 4, 2), spec(pb.FLOAT16, 2, 4, 2), "key_spec has 1 kv heads but value_spec has 2"),
])
def test_impossible_specs_are_named(key, value, message):
    with pytest.raises(LayoutError, match=message):
        layer_layout(key, value, tokens=4)


def test_layer_checksum_is_xxh3_64_of_k_then_v():
    k, v = b"\x01\x02" * 10, b"\x03" * 7
    assert layer_checksum(k, memoryview(v)) == xxhash.xxh3_64_intdigest(k + v)
    assert layer_checksum(v, k) != layer_checksum(k, v)


def test_tier_names_fastest_first():
    assert tiers.ORDER == (tiers.GPU, tiers.HOST, tiers.DISK, tiers.REMOTE) == ("gpu", "host", "disk", "remote")
