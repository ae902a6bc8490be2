"""Hostile or broken requests against the real server: a clear status, never INTERNAL or
UNKNOWN, no traceback in the log, nothing held or lost."""

from __future__ import annotations

import math
import uuid

import grpc
import pytest
import torch

from kvclient.client import KVClient, plan_request
from kvclient.errors import InvalidArgumentError, KVCraftError, NotFoundError, ResourceExhaustedError
from kvcraft.keys import ModelSpec
from kvcraft.plans import prefix_keys
from kvcraft.v1 import kvcraft_pb2 as pb
from kvcraft.v1 import kvcraft_pb2_grpc as pb_grpc

MODEL = ModelSpec("hostile", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32").fingerprint()


def tokens(i: int, n: int = 4) -> list[int]:
    return [i * 100 + t for t in range(n)]


def layers(n: int = 4):
    return [(torch.full((1, n, 4), float(i)), torch.full((1, n, 4), -float(i))) for i in range(2)]


def raw_unary(channel: grpc.Channel, method: str):
    return channel.unary_unary(method, request_serializer=None, response_deserializer=None)


# -- item 1: lease ttls ------------------------------------------------------------------
@pytest.mark.parametrize("ttl", [math.nan, math.inf, -math.inf, 1e30, -1.0])
def test_non_finite_or_huge_lease_ttl_is_refused_and_holds_nothing(kvserver, ttl):
    with KVClient(kvserver.address, timeout=10) as c:
        key = c.store(MODEL, tokens(1), layers()).chunk_key
        with pytest.raises(InvalidArgumentError, match="ttl_s"):
            c.lease([key], ttl_s=ttl)
        with pytest.raises(InvalidArgumentError, match="lease_ttl_s"):
            c.fetch_local([key], ttl_s=ttl).release()
        with pytest.raises(InvalidArgumentError, match="lease_ttl_s"):
            c.plan(MODEL, [tokens(1)], question_tokens=3, lease_ttl_s=ttl)
        assert c.stats().leases == 0
        flushed = c.flush()  # nothing protects the variant: no lease was registered
        assert (flushed.evicted, flushed.skipped_protected) == (1, 0)
    assert "Traceback" not in kvserver.log()


def test_leases_past_max_leases_are_refused_until_one_ends(start_server):
    """A client that takes leases and never releases them cannot pin the whole cache
    or grow the service's memory without bound: past max_leases, every way to take a
    lease (Lease, Locate, a Plan that reuses a variant) is RESOURCE_EXHAUSTED naming the
    limit; Stores and reads go on; a Release makes room again."""
    server = start_server(max_leases=3)
    with KVClient(server.address, timeout=10) as c:
        key = c.store(MODEL, tokens(1), layers()).chunk_key
        held = [c.lease([key]).lease_id for _ in range(3)]
        with pytest.raises(ResourceExhaustedError, match="3 leases are outstanding; max_leases is 3"):
            c.lease([key])
        with pytest.raises(ResourceExhaustedError, match="max_leases"):
            c.fetch_local([key]).release()
        with pytest.raises(ResourceExhaustedError, match="max_leases"):
            c.plan(MODEL, [tokens(1)], question_tokens=3)
        other = c.store(MODEL, tokens(2), layers()).chunk_key
        assert torch.equal(c.fetch(other)[1][0], layers()[1][0])
        assert c.stats().leases == 3
        assert c.release(held[0])
        plan = c.plan(MODEL, [tokens(1)], question_tokens=3)
        assert plan.lease_id and plan.chunks[0].variant_id  # it reuses the stored variant again
    assert "Traceback" not in server.log()


# -- item 2: Plan timings ----------------------------------------------------------------
def test_plan_timing_for_an_unknown_tier_is_invalid_argument(kvserver):
    timings = pb.TimingReport(loads=[pb.TimingReport.Load(tier="tape", bytes_per_layer=1e6, seconds=0.01)])
    with KVClient(kvserver.address) as c:
        with pytest.raises(InvalidArgumentError, match="tape"):
            c.plan(MODEL, [tokens(1)], question_tokens=3, timings=timings)
    assert "Traceback" not in kvserver.log()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 1e300])
def test_non_finite_timings_are_refused_and_do_not_poison_later_plans(kvserver, bad):
    loads = [pb.TimingReport.Load(tier="disk", bytes_per_layer=b, seconds=s)
             for b, s in ((1e6, bad), (2e6, bad), (3e6, bad), (bad, 0.01))]
    computes = [pb.TimingReport.Compute(tokens_per_layer=100, seconds=bad)]
    with KVClient(kvserver.address) as c:
        c.store(MODEL, tokens(1), layers())
        for load in loads:
            with pytest.raises(InvalidArgumentError, match="timings.loads"):
                c.plan(MODEL, [tokens(1)], question_tokens=3, timings=pb.TimingReport(loads=[load]))
        with pytest.raises(InvalidArgumentError, match="timings.computes"):
            c.plan(MODEL, [tokens(1)], question_tokens=3, timings=pb.TimingReport(computes=computes))
        plan = c.plan(MODEL, [tokens(1)], question_tokens=3)  # reuses the stored variant
        assert plan.chunks[0].source != pb.ChunkPlan.FRESH
        assert math.isfinite(plan.load_s_per_layer) and plan.load_s_per_layer > 0
        c.release(plan.lease_id)
    assert "Traceback" not in kvserver.log()


# -- keys that are not keys, and a status message's size ----------------------------------
@pytest.mark.parametrize("field", ["chunk_key", "variant_id"])
@pytest.mark.parametrize("bad", ["00", "A" * 32, "q" * 100_000, "é" * 40_000])
def test_a_malformed_key_to_evict_pin_or_unpin_is_invalid_argument_naming_it(kvserver, field, bad):
    """Not NOT_FOUND (a key of the wrong form is a caller's bug, not an absent chunk), and never
    the whole key echoed: a 100 KB one in the status would pass grpc's trailer limit, and the
    caller would see RESOURCE_EXHAUSTED for a size no one asked about."""
    with KVClient(kvserver.address, timeout=10) as c:
        key = c.store(MODEL, tokens(1), layers()).chunk_key
        for call in (c.evict, c.pin, c.unpin):
            with pytest.raises(InvalidArgumentError,
                               match=f"INVALID_ARGUMENT: {field} .* is not 32 lowercase hex chars") as e:
                call(**{field: bad})
            assert len(str(e.value)) < 200
        with pytest.raises(NotFoundError, match="is not stored"):  # a well-formed key stored nowhere
            c.evict(**{field: "0" * 32})
        assert c.stats().variants == 1 and c.evict(chunk_key=key).evicted == 1
        if field == "chunk_key":  # (once) a listing's model filter, likewise
            with pytest.raises(InvalidArgumentError, match="INVALID_ARGUMENT: model_id .* is not 32 lowercase hex"):
                c.list_chunks(model_id=bad)
    assert "Traceback" not in kvserver.log()


def test_a_status_message_is_cut_to_what_a_grpc_trailer_carries():
    from kvservice.errors import InvalidArgument
    from kvservice.server.status import MAX_MESSAGE_BYTES, status_of

    for text in ("x" * 100_000, "é" * 50_000, "ok"):
        code, message = status_of(InvalidArgument(text), "Test")
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert len(message.encode()) <= MAX_MESSAGE_BYTES
        assert message == text if len(text.encode()) <= MAX_MESSAGE_BYTES else message.startswith(text[:100])
        assert (message == text) or f"cut from {len(text.encode()):,} bytes" in message


# -- item 3: bytes that are not protobuf -------------------------------------------------
GARBAGE = [b"\x0a\xff", b"\xff\xff\xff\xff", b"\x0a\x02\xff\xfe"]  # truncated, bad tag, bad UTF-8


@pytest.mark.parametrize("method", ["/kvcraft.v1.KVCache/Lookup", "/kvcraft.v1.KVCache/Plan",
                                    "/kvcraft.v1.KVCache/Lease", "/kvcraft.v1.Admin/GetChunk",
                                    "/kvcraft.v1.Admin/Evict"])
def test_unparseable_unary_request_is_invalid_argument_without_traceback(kvserver, method):
    with grpc.insecure_channel(kvserver.address) as ch:
        call = raw_unary(ch, method)
        for data in GARBAGE:
            with pytest.raises(grpc.RpcError) as e:
                call(data, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert "kvcraft.v1." in e.value.details()
    assert "Traceback" not in kvserver.log()


def test_unparseable_fetch_request_is_invalid_argument(kvserver):
    with grpc.insecure_channel(kvserver.address) as ch:
        call = ch.unary_stream("/kvcraft.v1.KVCache/FetchLayers", request_serializer=None,
                               response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            list(call(GARBAGE[0], timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Traceback" not in kvserver.log()


def test_unparseable_message_inside_a_store_stream_is_invalid_argument(kvserver):
    from kvclient.client import store_requests

    good = [m.SerializeToString() for m in store_requests(MODEL, tokens(2), layers())]
    with grpc.insecure_channel(kvserver.address) as ch:
        call = ch.stream_unary("/kvcraft.v1.KVCache/Store", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            call(iter([good[0], GARBAGE[1], *good[1:]]), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "StoreRequest" in e.value.details()
    with KVClient(kvserver.address) as c:
        assert not c.lookup(MODEL, tokens(2)).found
        assert c.stats().variants == 0
    assert "Traceback" not in kvserver.log()


# -- item 4: token-count limits ----------------------------------------------------------
def test_lookup_over_max_chunk_tokens_is_resource_exhausted(start_server):
    server = start_server(max_chunk_tokens=1000)
    with KVClient(server.address) as c:
        assert not c.lookup(MODEL, list(range(1000))).found  # at the limit: fine
        with pytest.raises(ResourceExhaustedError, match="max_chunk_tokens"):
            c.lookup(MODEL, list(range(1001)))


def test_plan_chunk_over_max_chunk_tokens_is_resource_exhausted(start_server):
    server = start_server(max_chunk_tokens=1000)
    with KVClient(server.address) as c:
        with pytest.raises(ResourceExhaustedError, match=r"chunks\[1\].*max_chunk_tokens"):
            c.plan(MODEL, [tokens(1), list(range(1001))], question_tokens=3)
        with pytest.raises(ResourceExhaustedError, match=r"chunks\[0\].*max_chunk_tokens"):
            c.plan(MODEL, [("0" * 32, 1_000_000)], question_tokens=3)


# -- item 5: a long conversation ---------------------------------------------------------
def test_plan_response_stays_bounded_however_long_the_conversation(start_server):
    per_turn, cap = 32, 64
    server = start_server(max_conversation_chunks=cap)
    sizes = []
    with KVClient(server.address) as c, grpc.insecure_channel(server.address) as channel:
        unary = pb_grpc.KVCacheStub(channel).Plan  # the response as it crosses the wire, to measure it
        for turn in range(12):
            chunks = [(f"{turn:08x}{i:024x}", 16) for i in range(per_turn)]
            plan = unary(plan_request(MODEL, chunks, 8, conversation_id="long-talk"))
            assert sorted(plan.order) == sorted(k for k, _ in chunks)  # all new: nothing dropped
            assert len(plan.history) == min(turn * per_turn, cap)
            # Each chunk's prefix is the remembered history, then this turn's chunks before it.
            assert prefix_keys(plan, plan.chunks[3]) == [*plan.history, *plan.order[:3]]
            sizes.append(plan.ByteSize())
        # The earliest turn is forgotten: sending its chunks again is not deduplicated,
        # and the latest turn's chunks still are.
        again = c.plan(MODEL, [(f"{0:08x}{0:024x}", 16), (f"{11:08x}{0:024x}", 16)], question_tokens=8,
                       conversation_id="long-talk")
        assert list(again.dropped) == [f"{11:08x}{0:024x}"]
    assert max(sizes[2:]) == sizes[2]  # once the history is full the response stops growing


# -- item 12: the server's status reaches an asyncio client that is still writing -------
def test_async_client_sees_the_servers_status_when_a_store_is_refused_mid_stream(shared_server, request):
    import asyncio

    from kvclient.client import AsyncKVClient
    from kvcraft.records import VariantStats

    name = f"hostile-async-{request.node.name}-{uuid.uuid4().hex}"  # in the shared service, chunks of its own
    model = ModelSpec(name, num_layers=48, num_kv_heads=1, head_dim=64, dtype="float32").fingerprint()
    big = [(torch.zeros(1, 256, 64), torch.zeros(1, 256, 64)) for _ in range(48)]  # 6 MiB after the header
    bad_stats = VariantStats(token_inter_attention=(0.5,))  # 1 value for 256 tokens: refused at the header

    async def attempts() -> list[str]:
        codes = []
        async with AsyncKVClient(shared_server.address) as c:
            for i in range(12):
                try:
                    await c.store(model, list(range(i, i + 256)), big, stats=bad_stats)
                    codes.append("OK")
                except KVCraftError as e:
                    codes.append(e.code.name)
        return codes

    # grpc/grpc#36066: without the server reading the rest of a refused stream, about half
    # of these arrive as INTERNAL "Internal error from Core".
    assert asyncio.run(attempts()) == ["INVALID_ARGUMENT"] * 12
