"""PlanStream (AsyncKVClient.plan and KVClient.plan) against a real server: the same
plans as the unary Plan, a refused request answered in the stream while the stream goes
on, a caller that gives up leaving no lease behind, a restarted service, the auth token;
for the blocking client also callers on many threads, timeouts against a service that
never answers, and close."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from concurrent import futures

import grpc
import pytest

from kvclient.client import AsyncKVClient, KVClient, plan_request
from kvclient.errors import DeadlineExceededError, InvalidArgumentError, KVCraftError, UnavailableError
from kvclient.messages import plan_of
from kvcraft.keys import ModelSpec, chunk_key
from kvcraft.plans import Plan
from kvcraft.v1 import kvcraft_pb2 as pb
from kvcraft.v1 import kvcraft_pb2_grpc as pb_grpc
from tests.conftest import random_layers

MODEL_SHAPE = dict(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32")  # `model`: the same under a name of its own
MODEL = ModelSpec("plan-stream", **MODEL_SHAPE).fingerprint()


def tokens(i: int) -> list[int]:
    return [i * 10 + t for t in range(6)]


def _store_some(c: KVClient) -> None:
    k0 = c.store(MODEL, tokens(0), random_layers(0, (1, 6, 4))).chunk_key
    c.store(MODEL, tokens(1), random_layers(1, (1, 6, 4)), prefix_keys=[k0])
    c.store(MODEL, tokens(2), random_layers(2, (1, 6, 4)))


def _fields(p: Plan | pb.PlanResponse) -> Plan:
    """A plan as the client's record, without its lease (each Plan takes its own)."""
    return dataclasses.replace(p if isinstance(p, Plan) else plan_of(p), lease_id="", lease_expires_unix_ms=0)


def _unary_plans(address: str, requests: list) -> list[pb.PlanResponse]:
    """The requests through the unary Plan RPC (a bare stub: no kvcraft client code)."""
    with grpc.insecure_channel(address) as ch:
        plan = pb_grpc.KVCacheStub(ch).Plan
        return [plan(plan_request(MODEL, r, 4, "conv" if i == 3 else "")) for i, r in enumerate(requests)]


REQUESTS = [[tokens(1), tokens(0)], [tokens(0), tokens(1), tokens(2)], [tokens(2)], [tokens(1), tokens(0)],
            [tokens(3), tokens(0)]]


def test_stream_plans_equal_unary_plans_and_a_refusal_does_not_end_the_stream(start_server):
    """Three services with the same variants get the same request sequence: one over the
    unary Plan, one through AsyncKVClient and one through KVClient (both PlanStream):
    every answer is the same plan. A request the service refuses fails alone."""
    a, b, c = start_server("a"), start_server("b"), start_server("c")
    for s in (a, b, c):
        with KVClient(s.address) as client:
            _store_some(client)

    async def run() -> list[Plan]:
        out = []
        async with AsyncKVClient(b.address) as client:
            for i, r in enumerate(REQUESTS):
                out.append(await client.plan(MODEL, r, question_tokens=4, conversation_id="conv" if i == 3 else ""))
                if i == 1:
                    with pytest.raises(InvalidArgumentError, match="model_id"):
                        await client.plan("not-a-model", r, question_tokens=4)
                    with pytest.raises(KVCraftError, match="max_chunk_tokens") as e:
                        await client.plan(MODEL, [list(range(100_000))], question_tokens=4)
                    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        return out

    streamed = asyncio.run(run())
    blocking = []
    with KVClient(c.address) as client:
        for i, r in enumerate(REQUESTS):
            blocking.append(client.plan(MODEL, r, question_tokens=4, conversation_id="conv" if i == 3 else ""))
            if i == 1:
                with pytest.raises(InvalidArgumentError, match="model_id"):
                    client.plan("not-a-model", r, question_tokens=4)
                with pytest.raises(KVCraftError, match="max_chunk_tokens") as e:
                    client.plan(MODEL, [list(range(100_000))], question_tokens=4)
                assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    unary = _unary_plans(a.address, REQUESTS)
    assert [_fields(p) for p in streamed] == [_fields(p) for p in unary]
    assert [_fields(p) for p in blocking] == [_fields(p) for p in unary]
    assert all(p.lease_id for p in streamed[:2]) and all(p.lease_id for p in blocking[:2])


def test_blocking_callers_on_many_threads_each_get_their_own_plan(kvserver):
    """One KVClient, 8 threads planning different requests at once over its one stream:
    each answer is the plan of its own request (answers keep the order requests went out)."""
    with KVClient(kvserver.address) as client:
        _store_some(client)
        requests = [[tokens(i % 4), tokens((i + 1) % 4)] if i % 2 else [tokens(i % 4)] for i in range(8)]
        got: dict[int, list[tuple[list[str], int]]] = {}
        start = threading.Barrier(8)

        def worker(i: int) -> None:
            start.wait()
            out = []
            for _ in range(25):
                p = client.plan(MODEL, requests[i], question_tokens=4)
                if p.lease_id:  # tokens(3) is not stored: a fresh chunk holds nothing
                    client.release(p.lease_id)
                out.append((sorted(p.order), sum(c.token_count for c in p.chunks)))
            got[i] = out

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert client.stats().leases == 0
    assert sorted(got) == list(range(8))
    for i, r in enumerate(requests):
        own = (sorted(chunk_key(MODEL, t) for t in r), 6 * len(r))
        assert got[i] == [own] * 25, i


def test_bytes_that_are_no_request_are_refused_in_the_stream(shared_server, model):
    """A message that does not parse is answered INVALID_ARGUMENT, and the next one planned."""
    good = pb.PlanRequest(model_id=model, chunks=[pb.PlanChunk(token_ids=tokens(0))], question_tokens=2)

    async def run() -> list[pb.PlanStreamResponse]:
        async with grpc.aio.insecure_channel(shared_server.address) as ch:
            call = ch.stream_stream("/kvcraft.v1.KVCache/PlanStream",
                                    response_deserializer=pb.PlanStreamResponse.FromString)()
            out = []
            for raw in (b"\xff\xff\xff", good.SerializeToString()):
                await call.write(raw)
                out.append(await call.read())
            await call.done_writing()
            return out

    bad, ok = asyncio.run(run())
    assert bad.WhichOneof("result") == "error" and bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "not a valid kvcraft.v1.PlanRequest" in bad.error.message
    assert ok.WhichOneof("result") == "plan" and list(ok.plan.order)


def test_a_caller_that_gives_up_leaves_no_lease(kvserver):
    """Its answer still arrives (answers keep their order); the lease in it is released."""
    with KVClient(kvserver.address) as c:
        _store_some(c)

    async def run() -> None:
        async with AsyncKVClient(kvserver.address) as c:
            waiting = asyncio.ensure_future(c.plan(MODEL, [tokens(1), tokens(0)], question_tokens=4))
            await asyncio.sleep(0)  # written, not answered yet
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            c.timeout = 1e-6  # no answer comes that fast
            with pytest.raises(DeadlineExceededError):
                await c.plan(MODEL, [tokens(0)], question_tokens=4)
            c.timeout = 30.0
            later = await c.plan(MODEL, [tokens(2)], question_tokens=4)  # the stream goes on
            assert later.lease_id and await c.release(later.lease_id)
            for _ in range(200):  # the two abandoned answers' leases are released as they arrive
                if (await c.stats()).leases == 0:
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"{(await c.stats()).leases} leases left")

    asyncio.run(run())


def test_a_blocking_caller_that_gives_up_leaves_no_lease(kvserver):
    with KVClient(kvserver.address) as c:
        _store_some(c)
        waiting = c.plan_future(MODEL, [tokens(1), tokens(0)], question_tokens=4)
        cancelled = waiting.cancel()  # False only when the answer came already
        c.timeout = 1e-6  # no answer comes that fast
        with pytest.raises(DeadlineExceededError):
            c.plan(MODEL, [tokens(0)], question_tokens=4)
        c.timeout = 30.0
        later = c.plan(MODEL, [tokens(2)], question_tokens=4)  # the stream goes on
        assert later.lease_id and c.release(later.lease_id)
        if not cancelled:
            c.release(waiting.result().lease_id)
        for _ in range(200):  # the abandoned answers' leases are released as they arrive
            if c.stats().leases == 0:
                return
            time.sleep(0.05)
        raise AssertionError(f"{c.stats().leases} leases left")


def _plan_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvcraft-plan")]


def _silent_service() -> tuple[grpc.Server, str]:
    """A real gRPC server whose PlanStream reads requests and never answers."""

    def plan_stream(requests, context):  # noqa: ANN001
        for _ in requests:
            pass
        return iter(())

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("kvcraft.v1.KVCache", {
        "PlanStream": grpc.stream_stream_rpc_method_handler(plan_stream)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_blocking_plans_time_out_in_deadline_order_and_close_ends_the_threads():
    """A later Plan with a shorter timeout fails at its own deadline, not behind the
    earlier one's; close fails what still waits and ends the client's threads."""
    server, address = _silent_service()
    try:
        before = set(_plan_threads())
        c = KVClient(address)
        slow = c.plan_future(MODEL, [tokens(0)], 4, timeout=60.0)
        t0 = time.monotonic()
        c.timeout = 0.3
        with pytest.raises(DeadlineExceededError, match="within 0.3 s"):
            c.plan(MODEL, [tokens(1)], question_tokens=4)
        assert time.monotonic() - t0 < 20  # its own 0.3 s, not the first Plan's 60
        assert not slow.done()
        c.close()
        with pytest.raises(UnavailableError):
            slow.result(30)
        with pytest.raises(UnavailableError, match="closed"):
            c.plan(MODEL, [tokens(0)], question_tokens=4)
        assert set(_plan_threads()) - before == set()
    finally:
        server.stop(0)


def test_a_blocking_client_dropped_without_close_ends_its_stream(shared_server, model):
    """Its threads hold the channel, not the client: once the client is collected its
    stream ends and the threads with it, so forgotten clients do not pile up threads."""
    import gc

    before = set(_plan_threads())
    c = KVClient(shared_server.address)
    assert c.plan(model, [tokens(0)], question_tokens=4).order
    assert len(set(_plan_threads()) - before) == 2  # reader and watchdog
    del c
    gc.collect()
    for _ in range(200):
        if not set(_plan_threads()) - before:
            return
        time.sleep(0.05)
    raise AssertionError(f"threads left: {set(_plan_threads()) - before}")


def test_the_stream_opens_again_after_the_service_restarts(start_server):
    server = start_server()
    with KVClient(server.address) as c:
        _store_some(c)

    async def run() -> None:
        async with AsyncKVClient(server.address) as c:
            assert (await c.plan(MODEL, [tokens(0)], question_tokens=4)).chunks
            server.restart()
            for _ in range(100):  # the first call after the restart may see the old call end
                try:
                    plan = await c.plan(MODEL, [tokens(0)], question_tokens=4)
                    break
                except KVCraftError as e:
                    assert e.code == grpc.StatusCode.UNAVAILABLE, e
                    await asyncio.sleep(0.05)
            else:
                raise AssertionError("no plan after the restart")
            assert plan.chunks[0].source != pb.ChunkPlan.FRESH and plan.chunks[0].variant_id  # recovered

    asyncio.run(run())


def test_the_stream_needs_the_token(start_server):
    server = start_server(auth_token="engine-secret")

    async def run(token: str | None) -> Plan:
        async with AsyncKVClient(server.address, token=token) as c:
            return await c.plan(MODEL, [tokens(0)], question_tokens=4)

    with pytest.raises(KVCraftError) as e:
        asyncio.run(run("wrong"))
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert asyncio.run(run("engine-secret")).chunks


def test_the_blocking_stream_opens_again_after_the_service_restarts_and_needs_the_token(start_server):
    server = start_server(auth_token="engine-secret")
    with KVClient(server.address, token="engine-secret") as c:
        _store_some(c)
        assert c.plan(MODEL, [tokens(0)], question_tokens=4).chunks
        server.restart()
        for _ in range(100):  # the first call after the restart may see the old call end
            try:
                plan = c.plan(MODEL, [tokens(0)], question_tokens=4)
                break
            except KVCraftError as e:
                assert e.code == grpc.StatusCode.UNAVAILABLE, e
                time.sleep(0.05)
        else:
            raise AssertionError("no plan after the restart")
        assert plan.chunks[0].source != pb.ChunkPlan.FRESH and plan.chunks[0].variant_id  # recovered
    with KVClient(server.address, token="wrong") as c:
        with pytest.raises(KVCraftError) as e:
            c.plan(MODEL, [tokens(0)], question_tokens=4)
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
