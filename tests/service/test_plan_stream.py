"""PlanStream (AsyncKVClient.plan) against a real server: the same plans as the unary
Plan, a refused request answered in the stream while the stream goes on, a caller that
gives up leaving no lease behind, a restarted service, and the auth token."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
import torch

from kvclient.client import AsyncKVClient, KVClient
from kvclient.errors import DeadlineExceededError, InvalidArgumentError, KVCraftError
from kvcraft.keys import ModelSpec
from kvcraft.v1 import kvcraft_pb2 as pb

MODEL = ModelSpec("plan-stream", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32").fingerprint()


def tokens(i: int) -> list[int]:
    return [i * 10 + t for t in range(6)]


def layers(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 6, 4, generator=g), torch.randn(1, 6, 4, generator=g)) for _ in range(2)]


def _store_some(c: KVClient) -> None:
    k0 = c.store(MODEL, tokens(0), layers(0)).chunk_key
    c.store(MODEL, tokens(1), layers(1), prefix_keys=[k0])
    c.store(MODEL, tokens(2), layers(2))


def _fields(p: pb.PlanResponse) -> tuple:
    """A plan without its lease (each Plan takes its own)."""
    p = pb.PlanResponse.FromString(p.SerializeToString())
    p.lease_id, p.lease_expires_unix_ms = "", 0
    return p.SerializeToString(deterministic=True)


def test_stream_plans_equal_unary_plans_and_a_refusal_does_not_end_the_stream(start_server):
    """Two services with the same variants get the same request sequence, one over the
    unary Plan, one over PlanStream: every answer is the same plan. A request the
    service refuses (a bad model id, too many tokens) fails alone."""
    a, b = start_server("a"), start_server("b")
    for s in (a, b):
        with KVClient(s.address) as c:
            _store_some(c)
    requests = [[tokens(1), tokens(0)], [tokens(0), tokens(1), tokens(2)], [tokens(2)], [tokens(1), tokens(0)],
                [tokens(3), tokens(0)]]

    async def run() -> list[pb.PlanResponse]:
        out = []
        async with AsyncKVClient(b.address) as c:
            for i, r in enumerate(requests):
                out.append(await c.plan(MODEL, r, question_tokens=4, conversation_id="conv" if i == 3 else ""))
                if i == 1:
                    with pytest.raises(InvalidArgumentError, match="model_id"):
                        await c.plan("not-a-model", r, question_tokens=4)
                    with pytest.raises(KVCraftError, match="max_chunk_tokens") as e:
                        await c.plan(MODEL, [list(range(100_000))], question_tokens=4)
                    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        return out

    streamed = asyncio.run(run())
    with KVClient(a.address) as c:
        unary = [c.plan(MODEL, r, question_tokens=4, conversation_id="conv" if i == 3 else "")
                 for i, r in enumerate(requests)]
    assert [_fields(p) for p in streamed] == [_fields(p) for p in unary]
    assert all(p.lease_id for p in streamed[:2])


def test_bytes_that_are_no_request_are_refused_in_the_stream(kvserver):
    """A message that does not parse is answered INVALID_ARGUMENT, and the next one planned."""
    good = pb.PlanRequest(model_id=MODEL, chunks=[pb.PlanChunk(token_ids=tokens(0))], question_tokens=2)

    async def run() -> list[pb.PlanStreamResponse]:
        async with grpc.aio.insecure_channel(kvserver.address) as ch:
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_stream_opens_again_after_the_service_restarts(start_server):
    server = start_server(port=_free_port())
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

    async def run(token: str | None) -> pb.PlanResponse:
        async with AsyncKVClient(server.address, token=token) as c:
            return await c.plan(MODEL, [tokens(0)], question_tokens=4)

    with pytest.raises(KVCraftError) as e:
        asyncio.run(run("wrong"))
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert asyncio.run(run("engine-secret")).chunks
