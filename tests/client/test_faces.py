"""KVClient and AsyncKVClient are two faces of one client core: the same public methods
with the same parameters, each answering the same against a real server, and the same
timeouts against a hung one.

Each face talks to a server of its own, started empty, and makes the same calls in the
same order; what they answer is compared step by step once the values that differ
between any two servers are set aside (random ids, clock times, the data directory).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import socket
import time
from typing import Any, Awaitable, Callable

import grpc
import pytest
import torch

from kvclient.client import AsyncKVClient, FetchStream, KVClient, Ref
from kvclient.errors import DeadlineExceededError, KVCraftError
from kvcraft.keys import ModelSpec
from kvcraft.plans import Plan
from kvcraft.records import VariantStats
from tests.conftest import random_layers

MODEL = ModelSpec("faces-test", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float16").fingerprint()
TOKENS_A, TOKENS_B = [1, 2, 3, 4, 5], list(range(10, 17))

# Where the asyncio face differs in kind, not in what it answers (kvclient.client's docstring).
ASYNC_ITERATORS = {"fetch_layers"}  # `async for`, as the blocking face's FetchStream is iterated
TASKS = {"plan_future", "match_prefix_future", "release_future"}  # an asyncio.Task, returned at once

# Fields that differ between two servers given the same calls: ids drawn at random, clock times.
DRAWN = {"lease_id", "instance_id", "segment", "lease_expires_unix_ms", "expires_unix_ms", "last_access_unix_ms",
         "created_unix_ms"}


def public_methods(cls: type) -> dict[str, Callable]:
    return {name: getattr(cls, name) for name in dir(cls)
            if not name.startswith("_") and callable(getattr(cls, name))}


def test_both_faces_have_the_same_methods_with_the_same_parameters():
    sync, aio = public_methods(KVClient), public_methods(AsyncKVClient)
    assert sorted(sync) == sorted(aio)
    for name, method in sync.items():
        assert list(inspect.signature(aio[name]).parameters.values()) == \
            list(inspect.signature(method).parameters.values()), name
        assert not inspect.iscoroutinefunction(method) and not inspect.isasyncgenfunction(method), name
        if name in ASYNC_ITERATORS:
            assert inspect.isasyncgenfunction(aio[name]), name
        elif name in TASKS:
            assert not inspect.iscoroutinefunction(aio[name]), name
        else:
            assert inspect.iscoroutinefunction(aio[name]), name


LAYERS_A, LAYERS_B = random_layers(1, (2, len(TOKENS_A), 4), dtype=torch.float16), random_layers(2, (2, len(TOKENS_B), 4), dtype=torch.float16)


def raw(t: torch.Tensor) -> tuple:
    return t.dtype, tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes()


def steady(msg: Any) -> Any:
    """A copy of `msg` (a message or a record) with each DRAWN field, where set, replaced by a marker."""
    if dataclasses.is_dataclass(msg):
        return dataclasses.replace(msg, **{f.name: type(v)(1) if isinstance(v, int) else "set"
                                           for f in dataclasses.fields(msg) if f.name in DRAWN
                                           and (v := getattr(msg, f.name))})
    out = type(msg)()
    out.CopyFrom(msg)
    for field, value in out.ListFields():
        if field.name in DRAWN:
            setattr(out, field.name, type(value)(1) if isinstance(value, int) else "set")
        elif field.message_type is not None:
            for m in (value if field.is_repeated else [value]):
                m.CopyFrom(steady(m))
    return out


async def answer(got: Any) -> Any:
    """What a call gave, whichever face made it: awaited, iterated or waited for."""
    if inspect.isawaitable(got):  # a coroutine, or an asyncio.Task
        return await got
    if hasattr(got, "__aiter__"):
        return [x async for x in got]
    if isinstance(got, FetchStream):
        return list(got)
    if isinstance(got, (concurrent.futures.Future, grpc.Future)):
        return got.result(timeout=30)
    return got


async def outcome(got: Callable[[], Any]) -> Any:
    try:
        return await answer(got())
    except KVCraftError as e:
        return type(e).__name__, e.code


class Recording:
    """A face that notes which of its methods the steps called."""

    def __init__(self, client: Any) -> None:
        self.client, self.called = client, set()

    def __getattr__(self, name: str) -> Any:
        self.called.add(name)
        return getattr(self.client, name)


# -- the steps: each makes its calls on one face and returns what it compares ------------
async def store(c: Any, s: dict) -> Any:
    s["a"] = await answer(c.store(MODEL, TOKENS_A, LAYERS_A))
    s["b"] = await answer(c.store(MODEL, TOKENS_B, LAYERS_B, prefix_keys=[s["a"].chunk_key],
                                  stats=VariantStats(a=0.25, b=0.5, prefix_attention=(0.25,))))
    return s["a"], s["b"], await answer(c.store(MODEL, TOKENS_A, LAYERS_A))


async def fetch(c: Any, s: dict) -> Any:
    layers = await answer(c.fetch(s["a"].chunk_key, device="cpu"))
    return [(raw(k), raw(v)) for k, v in layers], await outcome(lambda: c.fetch("0" * 32))


async def fetch_layers(c: Any, s: dict) -> Any:
    refs = [Ref(s["a"].chunk_key), Ref(s["b"].chunk_key, s["b"].variant_id)]
    got = await answer(c.fetch_layers(refs, first_layer=1, num_layers=1, device="cpu", timeout=30))
    return [(f.layer, f.index, f.variant_id, raw(f.key), raw(f.value)) for f in got]


async def lookup(c: Any, s: dict) -> Any:
    return (steady(await answer(c.lookup(MODEL, TOKENS_B))),
            steady(await answer(c.lookup(chunk_key=s["a"].chunk_key))))


def chain(s: dict) -> list[str]:
    return [s["a"].variant_id, s["b"].variant_id, "f" * 32]


async def match_prefix(c: Any, s: dict) -> Any:
    return await answer(c.match_prefix(chain(s), timeout=30))


async def match_prefix_future(c: Any, s: dict) -> Any:
    return await answer(c.match_prefix_future(chain(s), timeout=30))


async def lease(c: Any, s: dict) -> Any:
    got = await answer(c.lease([Ref(s["a"].chunk_key)], ttl_s=30))
    s["lease"] = got.lease_id
    return bool(got.lease_id), got.variant_ids, got.expires_unix_ms > time.time() * 1000


async def release(c: Any, s: dict) -> Any:
    return await answer(c.release(s["lease"])), await answer(c.release(s["lease"]))


async def release_future(c: Any, s: dict) -> Any:
    lease_id = (await answer(c.lease([s["b"].chunk_key]))).lease_id
    return await answer(c.release_future(lease_id)), await answer(c.release(lease_id))


async def plan(c: Any, s: dict) -> Any:
    got = await answer(c.plan(MODEL, [TOKENS_A, TOKENS_B], 3, conversation_id="", first_turn=None,
                              lease_ttl_s=30, timings=None))
    assert isinstance(got, Plan)
    return steady(got), await answer(c.release(got.lease_id))


async def plan_future(c: Any, s: dict) -> Any:
    got = await answer(c.plan_future(MODEL, [(s["a"].chunk_key, len(TOKENS_A)), TOKENS_B], 3, lease_ttl_s=30,
                                     timeout=30))
    assert isinstance(got, Plan)
    return steady(got), await answer(c.release(got.lease_id))


async def fetch_local(c: Any, s: dict) -> Any:
    got = await answer(c.fetch_local([s["a"].chunk_key, Ref(s["b"].chunk_key, s["b"].variant_id)], ttl_s=30))
    seen = (got.variant_ids, got.tier, [[(raw(k), raw(v)) for k, v in layers] for layers in got.layers],
            [steady(loc) for loc in got.locations])
    lease_id = got.lease_id
    await answer(got.release())
    return seen, await answer(c.release(lease_id))


async def admin(c: Any, s: dict) -> Any:
    a, b = s["a"], s["b"]
    first = await answer(c.list_chunks(model_id=MODEL, page_size=1))
    return (steady(await answer(c.stats())), first,
            await answer(c.list_chunks(MODEL, 1, first.next_page_token)),
            [steady(v) for v in await answer(c.get_chunk(a.chunk_key))],
            await answer(c.pin(chunk_key=a.chunk_key)), await answer(c.unpin(variant_id=a.variant_id)),
            await answer(c.evict(variant_id=b.variant_id)), await outcome(lambda: c.get_chunk(b.chunk_key)),
            await answer(c.flush()),
            (await answer(c.config())).replace(s["data_dir"], "<data_dir>"))


async def close(c: Any, s: dict) -> Any:
    return await answer(c.close())


STEPS: list[Callable[[Any, dict], Awaitable[Any]]] = [
    store, fetch, fetch_layers, lookup, match_prefix, match_prefix_future, lease, release, release_future, plan,
    plan_future, fetch_local, admin, close]


async def test_every_method_answers_the_same_through_both_faces(start_server):
    servers = start_server("sync"), start_server("async")
    faces = Recording(KVClient(servers[0].address)), Recording(AsyncKVClient(servers[1].address))
    states = [{"data_dir": str(s.data_dir)} for s in servers]
    try:
        for step in STEPS:
            want = await step(faces[0], states[0])
            got = await step(faces[1], states[1])
            assert got == want, step.__name__
    finally:
        if close.__name__ not in faces[1].called:
            faces[0].client.close()
            await faces[1].client.close()
    for face in faces:
        assert face.called == set(public_methods(KVClient)), type(face.client).__name__


@pytest.fixture
def silent_address():
    """A peer that accepts TCP connections and never answers: a hung server."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("face", [KVClient, AsyncKVClient])
async def test_both_faces_end_calls_to_a_hung_server_at_the_same_timeouts(silent_address, face):
    calls = [lambda c: c.stats(), lambda c: c.lookup(chunk_key="0" * 32), lambda c: c.lease(["0" * 32]),
             lambda c: c.store(MODEL, TOKENS_A, LAYERS_A), lambda c: c.plan(MODEL, [TOKENS_A], 3)]
    per_call = [lambda c: c.match_prefix(["f" * 32], timeout=0.3), lambda c: c.fetch_layers(["0" * 32], timeout=0.3),
                lambda c: c.plan_future(MODEL, [TOKENS_A], 3, timeout=0.3)]
    c = face(silent_address, timeout=3600)
    try:
        c.timeout = 0.3  # the default, changed after the client was made
        t0 = time.monotonic()
        for call in calls + per_call:  # the default, then each call's own below a default that would hang
            if call is per_call[0]:
                c.timeout = 3600
            with pytest.raises(DeadlineExceededError):
                await answer(call(c))
        assert time.monotonic() - t0 < 60
    finally:
        await answer(c.close())
