"""Identity (kvcraft.keys): what a stored chunk is found by, on every node and after upgrades."""

from __future__ import annotations

import struct

import numpy
import pytest
import torch
import xxhash

from kvcraft.keys import ModelSpec, chunk_key, is_key, variant_id
from kvcraft.v1 import kvcraft_pb2 as pb

SPEC = ModelSpec("golden", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float16")


def test_keys_are_the_documented_hashes():
    # docs/architecture.md "Identity": xxh3-128 over (model id, 0 byte, uint32 LE token ids),
    # and over (chunk key, "/" + each prefix key) for a variant.
    model_id = SPEC.fingerprint()
    tokens = [1, 2, 3, 2**32 - 1]
    want = xxhash.xxh3_128_hexdigest(model_id.encode() + b"\x00" + struct.pack("<4I", *tokens))
    assert chunk_key(model_id, tokens) == want
    a, b = chunk_key(model_id, [1]), chunk_key(model_id, [2])
    assert variant_id(want, [a, b]) == xxhash.xxh3_128_hexdigest(f"{want}/{a}/{b}".encode())
    assert variant_id(want, []) == xxhash.xxh3_128_hexdigest(want.encode())


@pytest.mark.parametrize("tokens", [
    list(range(70_000, 70_600)), (0, 2**32 - 1), range(3, 9), numpy.arange(5, 12, dtype=numpy.int64),
    numpy.arange(4, dtype=numpy.uint32), torch.arange(6), [True, 7], [3.0, 4], ["5", 6], b"\x01\x02", [],
    pb.ChunkTokens(token_ids=range(2**32 - 600, 2**32)).token_ids, pb.ChunkTokens().token_ids,
    numpy.array([3.0, 9.0]), numpy.array([True, False]), memoryview(b"\x07\x08"), torch.tensor([[1, 2]])[0],
    lambda: (t for t in [4, 5.0, 6]),
])
def test_a_chunk_key_is_the_same_whatever_sequence_holds_the_ids(tokens):
    """Token ids come as lists, tuples, ranges, numpy and torch values (a connector's
    block, a tokenizer's output), protobuf repeated fields (a Plan's or Store's ids):
    each gives the key of the same ints."""
    ids = [int(t) for t in (tokens() if callable(tokens) else tokens)]
    tokens = tokens() if callable(tokens) else tokens
    want = xxhash.xxh3_128_hexdigest(SPEC.fingerprint().encode() + b"\x00" + struct.pack(f"<{len(ids)}I", *ids))
    assert chunk_key(SPEC.fingerprint(), tokens) == want


def test_keys_do_not_change_between_versions():
    # Stored data is found by these values: a change here orphans every stored chunk.
    model_id = SPEC.fingerprint()
    assert model_id == "595ca6689a923c5e403af00594ca5d45"
    key = chunk_key(model_id, [1, 2, 3])
    assert key == "bc15b60ef7cac01bf4627de9e456323b"
    assert variant_id(key, [key]) == "ae0c8b7402d25ff0a3464c4a134bfe30"


@pytest.mark.parametrize("change", [
    {"name": "other"}, {"num_layers": 3}, {"num_kv_heads": 1}, {"head_dim": 8}, {"dtype": "bfloat16"},
    {"rope_theta": 500000.0}, {"rope_scaling": (("factor", 8.0),)},
])
def test_same_tokens_under_another_model_never_collide(change):
    other = ModelSpec(**{**SPEC.__dict__, **change})
    assert other.fingerprint() != SPEC.fingerprint()
    assert chunk_key(other.fingerprint(), [5, 6]) != chunk_key(SPEC.fingerprint(), [5, 6])


def test_prefix_order_makes_another_variant():
    m = SPEC.fingerprint()
    k, a, b = (chunk_key(m, [t]) for t in (1, 2, 3))
    assert variant_id(k, [a, b]) != variant_id(k, [b, a]) != variant_id(k, [])


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="model_id is empty"):
        chunk_key("", [1])
    with pytest.raises(ValueError, match=r"token id -1 is outside \[0, 2\^32\)"):
        chunk_key(SPEC.fingerprint(), [1, -1])
    with pytest.raises(ValueError, match=r"token id 4294967296 is outside \[0, 2\^32\)"):
        chunk_key(SPEC.fingerprint(), numpy.array([1, 2**32]))
    with pytest.raises(ValueError, match=r"token id -3 is outside \[0, 2\^32\)"):
        chunk_key(SPEC.fingerprint(), torch.tensor([5, -3]))
    assert is_key(SPEC.fingerprint())
    assert not is_key(SPEC.fingerprint().upper()) and not is_key("abc") and not is_key("g" * 32)
