"""AsyncKVClient against the real server: everything KVClient does, awaited.

The blocking KVClient is the reference: each async call is compared with the same call
made through it (or with the tensors stored), on the same server. That both faces have
the same methods and parameters, and answer every call alike, is tests/client/test_faces.py.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import torch

from kvclient.client import AsyncKVClient, KVClient, Ref
from kvclient.errors import InvalidArgumentError, NotFoundError, UnavailableError
from kvcraft.keys import ModelSpec, chunk_key, variant_id
from tests.conftest import random_layers

MODEL_SHAPE = dict(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float16")  # `model`: the same under a name of its own
MODEL = ModelSpec("async-test", **MODEL_SHAPE).fingerprint()


def assert_same_layers(got, want) -> None:
    assert len(got) == len(want)
    for (gk, gv), (wk, wv) in zip(got, want):
        assert gk.dtype == wk.dtype and gk.shape == wk.shape
        assert torch.equal(gk.view(torch.uint8), wk.view(torch.uint8))
        assert torch.equal(gv.view(torch.uint8), wv.view(torch.uint8))


async def test_store_fetch_lookup_and_match_prefix(shared_server, model):
    a, b = random_layers(1, (2, 5, 4), dtype=torch.float16), random_layers(2, (2, 7, 4), dtype=torch.float16)
    async with AsyncKVClient(shared_server.address) as c:
        ra = await c.store(model, [1, 2, 3, 4, 5], a)
        rb = await c.store(model, list(range(10, 17)), b, prefix_keys=[ra.chunk_key])
        assert ra.chunk_key == chunk_key(model, [1, 2, 3, 4, 5])
        assert rb.variant_id == variant_id(rb.chunk_key, [ra.chunk_key])
        assert_same_layers(await c.fetch(ra.chunk_key), a)
        got = [f async for f in c.fetch_layers([Ref(ra.chunk_key), Ref(rb.chunk_key, rb.variant_id)])]
        assert [(f.layer, f.index) for f in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert_same_layers([(got[i].key, got[i].value) for i in (1, 3)], b)
        found = await c.lookup(model, [1, 2, 3, 4, 5])
        assert [v.variant_id for v in found.variants] == [ra.variant_id]
        assert await c.match_prefix([ra.variant_id, rb.variant_id, "f" * 32]) == 2
        with pytest.raises(NotFoundError):
            await c.fetch(chunk_key(model, [99]))


async def test_fetch_local_aliases_the_stored_bytes_until_released(shared_server, model):
    layers = random_layers(3, (2, 6, 4), dtype=torch.float16)
    async with AsyncKVClient(shared_server.address) as c:
        r = await c.store(model, list(range(6)), layers)
        async with await c.fetch_local([r.chunk_key]) as got:
            assert got.variant_ids == [r.variant_id]
            assert_same_layers(got.layers[0], layers)
            lease_id = got.lease_id
            assert lease_id
        assert got.lease_id == ""
        assert await c.release(lease_id) is False  # already released on leaving the block


async def test_admin_calls_answer_as_the_blocking_client_does(kvserver):
    layers = random_layers(4, (2, 4, 4), dtype=torch.float16)
    with KVClient(kvserver.address) as s:
        r = s.store(MODEL, [4, 3, 2, 1], layers)
        want_list, want_chunk, want_config = s.list_chunks(), s.get_chunk(r.chunk_key), s.config()
    async with AsyncKVClient(kvserver.address) as c:
        assert await c.list_chunks() == want_list
        assert await c.get_chunk(r.chunk_key) == want_chunk
        assert await c.config() == want_config
        assert (await c.stats()).variants == 1
        assert await c.pin(chunk_key=r.chunk_key) == 1
        assert (await c.get_chunk(r.chunk_key))[0].pinned
        assert await c.unpin(variant_id=r.variant_id) == 1
        assert (await c.evict(chunk_key=r.chunk_key)).evicted == 1
        with pytest.raises(NotFoundError):
            await c.get_chunk(r.chunk_key)
        await c.flush()
        with pytest.raises(ValueError, match="exactly one"):
            await c.pin(chunk_key=r.chunk_key, variant_id=r.variant_id)
        with pytest.raises(InvalidArgumentError):
            await c.lease([Ref("not-a-key")])


@pytest.fixture
def silent_address():
    """A peer that accepts TCP connections and never answers: a hung server."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield f"127.0.0.1:{sock.getsockname()[1]}"


async def test_timeouts_end_calls_to_a_hung_server_as_unavailable(silent_address):
    # The client's default, then a per-call timeout below a default that would outlast the test.
    async with AsyncKVClient(silent_address, timeout=0.3) as c:
        with pytest.raises(UnavailableError, match="DEADLINE_EXCEEDED"):
            await c.stats()
    async with AsyncKVClient(silent_address, timeout=3600) as c:
        t0 = time.monotonic()
        with pytest.raises(UnavailableError, match="DEADLINE_EXCEEDED"):
            await c.match_prefix(["f" * 32], timeout=0.3)
        with pytest.raises(UnavailableError, match="DEADLINE_EXCEEDED"):
            [f async for f in c.fetch_layers([chunk_key(MODEL, [1])], timeout=0.3)]
        assert time.monotonic() - t0 < 60


async def test_a_cancelled_plan_future_leaves_no_lease(kvserver):
    layers = random_layers(5, (2, 4, 4), dtype=torch.float16)
    async with AsyncKVClient(kvserver.address) as c:
        r = await c.store(MODEL, [9, 8, 7, 6], layers)
        given_up = [c.plan_future(MODEL, [(r.chunk_key, 4)], 3) for _ in range(5)]
        assert all(isinstance(t, asyncio.Task) for t in given_up)
        for t in given_up:
            t.cancel()
        kept = await c.plan_future(MODEL, [(r.chunk_key, 4)], 3)  # the stream goes on
        assert kept.lease_id and await c.release(kept.lease_id)
        for _ in range(200):  # the cancelled ones' answers are released as they arrive
            if (await c.stats()).leases == 0:
                break
            await asyncio.sleep(0.05)
        assert (await c.stats()).leases == 0


async def test_futures_raise_client_errors_and_a_forgotten_release_still_happens(kvserver):
    layers = random_layers(6, (2, 4, 4), dtype=torch.float16)
    async with AsyncKVClient(kvserver.address) as c:
        r = await c.store(MODEL, [1, 3, 5, 7], layers)
        with pytest.raises(InvalidArgumentError):
            await c.match_prefix_future(["f" * 32] * 100_000)  # over max_fetch_variants
        assert (await c.match_prefix_future([r.variant_id])).matched == 1
        for _ in range(20):
            c.release_future((await c.lease([r.chunk_key])).lease_id)  # dropped at once
        for _ in range(200):
            if (await c.stats()).leases == 0:
                break
            await asyncio.sleep(0.05)
        assert (await c.stats()).leases == 0
