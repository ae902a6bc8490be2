"""kvcraft.codec against protobuf itself: the hand-built layer messages are byte for byte
what SerializeToString makes, decode back to the same fields, and anything not in the
canonical form is left to protobuf (decoders answer None)."""

from __future__ import annotations

import random
import uuid

import grpc
import pytest
import torch

from kvclient.client import KVClient, store_header
from kvcraft.keys import ModelSpec
from kvcraft import codec
from kvcraft.v1 import kvcraft_pb2 as pb

SIZES = [0, 1, 127, 128, 16383, 16384, 70000]
LAYERS = [0, 1, 127, 128, 300, 2**21]


def test_store_layer_is_protobufs_own_encoding():
    rng = random.Random(1)
    for _ in range(120):
        layer = rng.choice(LAYERS)
        k, v = rng.randbytes(rng.choice(SIZES)), rng.randbytes(rng.choice(SIZES))
        want = pb.StoreRequest(layer=pb.LayerPayload(layer=layer, key=k, value=v)).SerializeToString()
        assert codec.encode_store_layer(layer, memoryview(k), bytearray(v)) == want
        got = codec.decode_store_layer(want)
        assert (got.layer, bytes(got.key), bytes(got.value)) == (layer, k, v)


def test_layer_chunk_is_protobufs_own_encoding():
    rng = random.Random(2)
    for _ in range(120):
        ks = pb.TensorSpec(dtype=rng.choice([pb.FLOAT16, pb.BFLOAT16, pb.FLOAT32]), shape=[2, rng.randint(1, 999), 8])
        vs = pb.TensorSpec(dtype=pb.FLOAT32, shape=[rng.randint(1, 9), 3, 4])
        msg = pb.LayerChunk(layer=rng.choice(LAYERS), index=rng.choice([0, 1, 200]), variant_id=rng.randbytes(16).hex(),
                            key_spec=ks, value_spec=vs, key=rng.randbytes(rng.choice(SIZES)),
                            value=rng.randbytes(rng.choice(SIZES)))
        head = codec.layer_chunk_head(msg.layer, msg.index, msg.variant_id, ks.SerializeToString(), vs.SerializeToString())
        wire = codec.encode_layer_chunk(head, memoryview(msg.key), msg.value)
        assert wire == msg.SerializeToString()
        got = codec.decode_layer_chunk(wire)
        assert (got.layer, got.index, got.variant_id, got.key_spec, got.value_spec, bytes(got.key), bytes(got.value)) \
            == (msg.layer, msg.index, msg.variant_id, ks, vs, msg.key, msg.value)


def test_layer_chunk_decodes_from_any_buffer_with_offsets_into_the_bytes():
    ks = pb.TensorSpec(dtype=pb.BFLOAT16, shape=[1, 3, 2])
    msg = pb.LayerChunk(layer=300, index=2, variant_id="v" * 40, key_spec=ks, value_spec=ks, key=b"k" * 12,
                        value=b"w" * 12).SerializeToString()
    got = codec.decode_layer_chunk(msg)
    assert got.message is msg
    assert msg[got.key_offset : got.key_offset + 12] == b"k" * 12
    assert msg[got.value_offset : got.value_offset + 12] == b"w" * 12
    for buf in (bytearray(msg), memoryview(msg)):
        other = codec.decode_layer_chunk(buf)
        assert other.message is None
        assert (other.layer, other.index, other.variant_id, other.key_spec, bytes(other.key), bytes(other.value)) \
            == (300, 2, "v" * 40, ks, b"k" * 12, b"w" * 12)


_CHUNK = pb.LayerChunk(layer=3, index=1, variant_id="ab", key_spec=pb.TensorSpec(dtype=pb.FLOAT16, shape=[1]),
                       key=b"kk", value=b"vv").SerializeToString()


@pytest.mark.parametrize("data", [
    b"\x10\x01\x08\x03",  # index before layer: valid protobuf, not canonical
    b"\x08\x03\x08\x04",  # layer twice
    b"\x08\x03\x40\x01",  # unknown field 8
    b"\x80\x01\x01",  # field 16
    b"\x0a\x01\x03",  # layer as a length-delimited field
    b"\x1a\x01",  # variant id truncated
    b"\x32\x05kk",  # key shorter than its length
    b"\x08\xff",  # truncated varint
    b"\x1a\x02\xff\xfe",  # a variant id that is not UTF-8
    b"\x22\x02\xff\xff",  # a key spec protobuf refuses
    _CHUNK[:-1],  # the last byte missing
])
def test_non_canonical_layer_chunks_are_left_to_protobuf(data):
    assert codec.decode_layer_chunk(data) is None


def test_a_canonical_layer_chunk_decodes():
    got = codec.decode_layer_chunk(_CHUNK)
    assert (got.layer, got.index, got.variant_id, got.key_spec.shape[:], bytes(got.key), bytes(got.value)) \
        == (3, 1, "ab", [1], b"kk", b"vv")


@pytest.mark.parametrize("data", [
    pb.StoreRequest(header=pb.StoreHeader(model_id="m")).SerializeToString(),  # a header, not a layer
    b"\x12\x04\x1a\x02ab" + b"\x12\x00",  # field 2 twice
    b"\x12\x06\x1a\x01a\x12\x01b",  # value before key: valid protobuf, not canonical
    b"\x12\x09\x08\x01",  # truncated
    b"\x12\x02\x28\x01",  # unknown field 5
])
def test_non_canonical_store_messages_are_left_to_protobuf(data):
    assert codec.decode_store_layer(data) is None


def test_server_takes_a_layer_in_any_valid_encoding(shared_server, request):
    """Value before key is valid protobuf: the server's fast parser passes it to protobuf."""
    name = f"codec-{request.node.name}-{uuid.uuid4().hex}"  # in the shared service, a chunk of its own
    model = ModelSpec(name, num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32").fingerprint()
    k, v = torch.arange(8, dtype=torch.float32).reshape(1, 2, 4), -torch.arange(8, dtype=torch.float32).reshape(1, 2, 4)
    kb, vb = k.numpy().tobytes(), v.numpy().tobytes()
    inner = b"\x1a" + bytes([len(vb)]) + vb + b"\x12" + bytes([len(kb)]) + kb  # field 3, then field 2
    layer_msg = b"\x12" + bytes([len(inner)]) + inner
    assert pb.StoreRequest.FromString(layer_msg).layer.key == kb
    header = pb.StoreRequest(header=store_header(model, [5, 6], [(k, v)])).SerializeToString()
    with grpc.insecure_channel(shared_server.address) as ch:
        store = ch.stream_unary("/kvcraft.v1.KVCache/Store", response_deserializer=pb.StoreResponse.FromString)
        r = store(iter([header, layer_msg]), timeout=30)
    with KVClient(shared_server.address) as c:
        ((gk, gv),) = c.fetch(r.chunk_key)
    assert torch.equal(gk, k) and torch.equal(gv, v)
