"""Store -> fetch through the real server on loopback: bytes, restarts, errors."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
import torch

from kvclient.client import KVClient, Ref, store_requests
from kvclient.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from kvcraft.keys import ModelSpec, chunk_key, variant_id
from kvcraft.v1 import kvcraft_pb2 as pb
from kvcraft.v1 import kvcraft_pb2_grpc as pb_grpc
from tests.conftest import random_layers

MODEL_SHAPE = dict(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16")  # `model`: the same under a name of its own
MODEL = ModelSpec("test-llama", **MODEL_SHAPE).fingerprint()


def assert_bit_identical(got, want) -> None:
    assert len(got) == len(want)
    for (gk, gv), (wk, wv) in zip(got, want):
        assert gk.dtype == wk.dtype and gk.shape == wk.shape
        assert torch.equal(gk.view(torch.uint8), wk.view(torch.uint8))
        assert torch.equal(gv.view(torch.uint8), wv.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_store_then_fetch_returns_bit_identical_tensors(shared_server, model, dtype):
    layers = random_layers(0, (2, 17, 8), 3, dtype)
    tokens = list(range(100, 117))
    with KVClient(shared_server.address) as c:
        r = c.store(model, tokens, layers)
        assert r.chunk_key == chunk_key(model, tokens)  # independent recomputation of the key
        assert r.variant_id == variant_id(r.chunk_key, [])
        assert r.bytes_stored == sum(k.numel() * k.element_size() * 2 for k, _ in layers)
        assert_bit_identical(c.fetch(r.chunk_key), layers)


def test_fetch_is_layer_major_across_chunks(shared_server, model):
    a, b = random_layers(1, (2, 5, 8), 3, torch.float32), random_layers(2, (2, 9, 8), 3, torch.float32)
    with KVClient(shared_server.address) as c:
        ka = c.store(model, [1, 2, 3, 4, 5], a).chunk_key
        kb = c.store(model, [7] * 9, b).chunk_key
        got = list(c.fetch_layers([ka, kb]))
    assert [(f.layer, f.index) for f in got] == [(l, i) for l in range(3) for i in range(2)]
    for f in got:
        want = (a, b)[f.index][f.layer]
        assert torch.equal(f.key, want[0]) and torch.equal(f.value, want[1])


def test_store_survives_restart(start_server):
    server = start_server()
    layers = random_layers(3, (2, 11, 8), 3, torch.bfloat16)
    with KVClient(server.address) as c:
        key = c.store(MODEL, list(range(11)), layers).chunk_key
    server.restart()
    with KVClient(server.address) as c:
        assert_bit_identical(c.fetch(key), layers)
        assert c.stats().variants == 1


def test_fetch_of_missing_chunk_is_not_found(shared_server, model):
    missing = chunk_key(model, [9, 9, 9])
    with KVClient(shared_server.address) as c:
        with pytest.raises(NotFoundError, match=missing):
            c.fetch(missing)
        assert not c.lookup(model, [9, 9, 9]).found


def _raw_store(address: str, requests: list[pb.StoreRequest]) -> grpc.RpcError:
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.KVCacheStub(ch).Store(iter(requests), timeout=30)
    return e.value


def _requests(layers, tokens=None, **header_changes):
    tokens = tokens or list(range(layers[0][0].shape[1]))
    reqs = list(store_requests(MODEL, tokens, layers))
    for k, v in header_changes.items():
        if isinstance(v, list):
            getattr(reqs[0].header, k)[:] = v
        elif isinstance(v, pb.TensorSpec):
            getattr(reqs[0].header, k).CopyFrom(v)
        else:
            setattr(reqs[0].header, k, v)
    return reqs


def _malformed_cases():
    layers = random_layers(4, (2, 6, 8), 3, torch.float16)
    reqs = _requests(layers)
    yield "too few layers", reqs[:-1], "stream ended after 2 of header.num_layers=3"
    yield "too many layers", _requests(layers, num_layers=2), "past header.num_layers=2"
    yield "layers out of order", [reqs[0], reqs[2], reqs[1], reqs[3]], "expected layer 0, got layer 1"
    bad_shape = pb.TensorSpec(dtype=pb.FLOAT16, shape=[2, 7, 8])
    yield "shape/token mismatch", _requests(layers, key_spec=bad_shape), "key_spec.shape[1] is 7 but the chunk has 6"
    yield "two-dim shape", _requests(layers, value_spec=pb.TensorSpec(dtype=pb.FLOAT16, shape=[2, 6])), "value_spec.shape"
    yield "dtype mismatch", _requests(layers, key_spec=pb.TensorSpec(dtype=pb.FLOAT32, shape=[2, 6, 8])), "key has 192 bytes; key_spec needs 384"
    yield "no dtype", _requests(layers, value_spec=pb.TensorSpec(shape=[2, 6, 8])), "value_spec.dtype"
    short = [r for r in reqs]
    short[2] = pb.StoreRequest(layer=pb.LayerPayload(layer=1, key=reqs[2].layer.key[:-2], value=reqs[2].layer.value))
    yield "byte length not matching shape", short, "layer 1: key has 190 bytes"
    yield "empty model id", _requests(layers, model_id=""), "model_id is empty"
    yield "bad model id", _requests(layers, model_id="llama"), "model_id"
    yield "empty tokens", [pb.StoreRequest(header=pb.StoreHeader(model_id=MODEL, num_layers=1))], "token_ids is empty"
    yield "bad prefix key", _requests(layers, prefix_keys=["nope"]), "prefix_keys[0]"
    yield "layer first", reqs[1:], "first message of a Store stream must be a header"
    yield "empty stream", [], "empty Store stream"


@pytest.mark.parametrize("name,requests,message", list(_malformed_cases()), ids=[c[0] for c in _malformed_cases()])
def test_malformed_store_is_invalid_argument_and_loses_nothing(kvserver, name, requests, message):
    keep = random_layers(5, (2, 4, 8), 3, torch.float32)
    with KVClient(kvserver.address) as c:
        key = c.store(MODEL, [1, 2, 3, 4], keep).chunk_key
        err = _raw_store(kvserver.address, requests)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert message in err.details()
        assert "Traceback" not in err.details()
        assert_bit_identical(c.fetch(key), keep)
        assert c.stats().variants == 1  # the bad one left nothing behind


@pytest.mark.parametrize("ref,message", [
    (Ref(""), "chunk_key '' is not a chunk key"),
    (Ref("zz"), "is not a chunk key"),
    (Ref("0" * 32, cfo=2.0), "cfo is 2.0; expected"),
])
def test_malformed_fetch_is_invalid_argument(shared_server, ref, message):
    with KVClient(shared_server.address) as c:
        with pytest.raises(InvalidArgumentError, match=message):
            list(c.fetch_layers([ref]))


def test_fetch_past_last_layer_is_invalid_argument(shared_server, model):
    with KVClient(shared_server.address) as c:
        key = c.store(model, [5], random_layers(0, (2, 1, 8), 3, torch.float16)).chunk_key
        with pytest.raises(InvalidArgumentError, match="the variants have 3 layers"):
            list(c.fetch_layers([key], first_layer=2, num_layers=2))


def test_oversized_message_is_resource_exhausted(start_server):
    server = start_server(max_message_bytes=1 << 20)
    keep = random_layers(6, (2, 4, 8), 3, torch.float32)
    big = random_layers(7, (2, 40_000, 8), 1, torch.float32)  # 2.4 MiB per layer message
    with KVClient(server.address) as c:
        key = c.store(MODEL, [1, 2, 3, 4], keep).chunk_key
        err = _raw_store(server.address, list(store_requests(MODEL, list(range(40_000)), big)))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in err.details()
        assert_bit_identical(c.fetch(key), keep)


def test_oversized_stream_is_resource_exhausted(start_server):
    server = start_server(max_variant_bytes=10_000, max_layers=4)
    keep = random_layers(8, (2, 4, 8), 1, torch.float32)
    with KVClient(server.address) as c:
        key = c.store(MODEL, [1, 2, 3, 4], keep).chunk_key
        with pytest.raises(ResourceExhaustedError, match="max_variant_bytes is 10000"):
            c.store(MODEL, list(range(100)), random_layers(0, (2, 100, 8), 2, torch.float32))
        with pytest.raises(InvalidArgumentError, match="num_layers is 5; expected 1..4"):
            c.store(MODEL, [1], random_layers(0, (2, 1, 8), 5, torch.float32))
        assert_bit_identical(c.fetch(key), keep)


def test_match_prefix_counts_the_stored_head_of_a_chain(shared_server, model):
    from kvcraft.keys import variant_id as vid_of
    with KVClient(shared_server.address) as c:
        chain, prev = [], []
        for i in range(4):  # block i stored behind block i-1's variant id
            tokens = [i, i + 1]
            if i != 2:
                r = c.store(model, tokens, random_layers(i, (2, 2, 8), 1, torch.float16), prefix_keys=prev)
                assert r.variant_id == vid_of(chunk_key(model, tokens), prev)
            vid = vid_of(chunk_key(model, tokens), prev)
            chain.append(vid)
            prev = [vid]
        assert c.match_prefix(chain) == 2  # block 2 is missing: the prefix ends there
        assert c.match_prefix(chain[:1]) == 1 and c.match_prefix([]) == 0
        assert c.match_prefix(chain[3:]) == 1


def test_client_vanishing_mid_store_leaves_nothing_behind(kvserver):
    reqs = list(store_requests(MODEL, list(range(6)), random_layers(9, (2, 6, 8), 3, torch.float32)))

    def dies_after_first_layer():
        yield reqs[0]
        yield reqs[1]
        raise ConnectionError("engine crashed")

    with grpc.insecure_channel(kvserver.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.KVCacheStub(ch).Store(dies_after_first_layer(), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNKNOWN  # the client's own iterator failed
    with KVClient(kvserver.address) as c:
        stats = c.stats()
        assert stats.variants == 0
        assert all(t.bytes_used == 0 for t in stats.tiers)
        key = c.store(MODEL, [1, 2], random_layers(0, (2, 2, 8), 3, torch.float32)).chunk_key  # still serving, room intact
        assert c.fetch(key)
    # The server learns of the cancellation after the client has returned: wait (bounded)
    # for the aborted session to remove its temporary file.
    deadline = time.monotonic() + 10
    while list((kvserver.data_dir / "payloads").rglob("*.tmp")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert list((kvserver.data_dir / "payloads").rglob("*.tmp")) == []


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGHUP"])  # SIGINT: Ctrl-C; SIGHUP: its terminal closed
def test_a_stop_signal_drains_and_exits_cleanly_keeping_data(start_server, sig):
    server = start_server()
    layers = random_layers(0, (2, 4, 8), 3, torch.float16)
    with KVClient(server.address) as c:
        key = c.store(MODEL, [1, 2, 3, 4], layers).chunk_key
    server.proc.send_signal(getattr(signal, sig))
    assert server.proc.wait(timeout=30) == 0  # (SIGHUP's default action ends a process with -1)
    assert "draining" in server.log()
    server.start()
    with KVClient(server.address) as c:
        assert_bit_identical(c.fetch(key), layers)
