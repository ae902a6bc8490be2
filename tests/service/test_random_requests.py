"""Random requests to every RPC of the real service: well-formed messages whose fields hold
edge values (empty, huge, negative, non-finite, unknown enum numbers, keys of chunks it holds
and strings that are no key), and valid requests of the client's own with one or two fields
changed. Every call ends with a status the contract names for bad input (never UNKNOWN or
INTERNAL, which a handler's unexpected exception gives) and a bounded message; the service
logs no traceback and keeps, bit for bit, every variant stored before (the Admin calls that
may drop variants run last).

The RPCs are read from the proto's descriptor: a new one is covered without a change here. A
fixed seed, so that a failure is replayed by running the test again."""

from __future__ import annotations

import math
import random
from typing import Any, Callable

import grpc
import torch
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import Message

from kvclient.client import KVClient
from kvclient.messages import fetch_request, lookup_request, plan_request, store_requests
from kvcraft.keys import ModelSpec
from kvcraft.records import StoreResult
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.server.status import MAX_MESSAGE_BYTES

MODEL = ModelSpec("random-requests", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32").fingerprint()
# What a call may end with: what bad input gets (the contract's statuses), or an answer.
ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION}
RANDOM_CALLS = 60  # per RPC
MUTANT_CALLS = 120  # per template of a valid request
INTS = [0, 1, 2, 3, 7, 255, 256, 65535, 2**31 - 1, 2**32 - 1, 2**63 - 1, -1, -2**31, -2**63]
FLOATS = [0.0, -0.0, 0.15, 1.0, 3.0, -1.0, 1e-9, 1e30, -1e30, math.inf, -math.inf, math.nan]
BITS32 = {FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32, FD.TYPE_UINT32, FD.TYPE_FIXED32}
UNSIGNED = {FD.TYPE_UINT32, FD.TYPE_FIXED32, FD.TYPE_UINT64, FD.TYPE_FIXED64}


def chunk_tokens(i: int) -> list[int]:
    return [i * 10 + t for t in range(4)]


class Values:
    """Random field values; strings are drawn half the time from `known` (keys and ids the
    service holds), so that requests get past the first check."""

    def __init__(self, rng: random.Random, known: list[str]) -> None:
        self.rng, self.known = rng, known

    def field(self, f: FD, depth: int) -> Any:
        r = self.rng
        if f.type == FD.TYPE_MESSAGE:
            return self.message(f.message_type._concrete_class, depth + 1)
        if f.type == FD.TYPE_ENUM:
            return r.choice([v.number for v in f.enum_type.values] + [999])
        if f.type == FD.TYPE_STRING:
            if r.random() < 0.5:
                return r.choice(self.known)
            return r.choice(["", "x", "a" * 5000, "\u00e9t\u00e9", "../x", "query", "cacheblend", "disk", "0" * 32,
                             "g" * 32, MODEL[:-1]])
        if f.type == FD.TYPE_BYTES:
            return bytes(r.randrange(256) for _ in range(r.choice([0, 1, 16, 64])))
        if f.type == FD.TYPE_BOOL:
            return r.random() < 0.5
        if f.type in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
            return r.choice(FLOATS)
        bits = 32 if f.type in BITS32 else 64
        v = r.choice(INTS + [r.randrange(1000)])
        return v % 2**bits if f.type in UNSIGNED else max(min(v, 2 ** (bits - 1) - 1), -2 ** (bits - 1))

    def message(self, cls: type[Message], depth: int = 0) -> Message:
        m = cls()
        for f in cls.DESCRIPTOR.fields if depth < 4 else ():
            if self.rng.random() < 0.35 or _is_map(f):
                continue
            if f.is_repeated:
                for _ in range(self.rng.choice([0, 1, 2, 3, 5, 40])):
                    _append(m, f, self.field(f, depth))
            else:
                _set(m, f, self.field(f, depth))
        return m

    def mutate(self, m: Message, depth: int = 0) -> None:
        """One field of `m`, or of a message inside it, dropped, changed or added to."""
        r = self.rng
        f = r.choice(m.DESCRIPTOR.fields)
        if _is_map(f):
            return
        if not f.is_repeated:
            if f.type == FD.TYPE_MESSAGE and m.HasField(f.name) and r.random() < 0.5:
                self.mutate(getattr(m, f.name), depth + 1)
            else:
                _set(m, f, self.field(f, depth))
            return
        items = getattr(m, f.name)
        if len(items) and f.type == FD.TYPE_MESSAGE and r.random() < 0.6:
            self.mutate(items[r.randrange(len(items))], depth + 1)
        elif len(items) and r.random() < 0.3:
            del items[r.randrange(len(items))]
        elif len(items) and f.type != FD.TYPE_MESSAGE and r.random() < 0.5:
            items[r.randrange(len(items))] = self.field(f, depth)
        else:
            _append(m, f, self.field(f, depth))


def _is_map(f: FD) -> bool:
    return f.message_type is not None and f.message_type.GetOptions().map_entry


def _set(m: Message, f: FD, v: Any) -> None:
    if f.type == FD.TYPE_MESSAGE:
        getattr(m, f.name).CopyFrom(v)
    else:
        setattr(m, f.name, v)


def _append(m: Message, f: FD, v: Any) -> None:
    items = getattr(m, f.name)
    if f.type == FD.TYPE_MESSAGE:
        items.add().CopyFrom(v)
    else:
        items.append(v)


def call(channel: grpc.Channel, method, request: Message | list[Message]) -> grpc.StatusCode:  # noqa: ANN001
    """`method` (a MethodDescriptor) with `request` (a list of messages for a client stream)."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    codec = {"request_serializer": method.input_type._concrete_class.SerializeToString,
             "response_deserializer": method.output_type._concrete_class.FromString}
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}
    stub = kind[method.client_streaming, method.server_streaming](path, **codec)
    try:
        answer = stub(iter(request) if method.client_streaming else request, timeout=20)
        if method.server_streaming:
            list(answer)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        details = e.details() or ""
        assert e.code() in ANSWERS, f"{method.name}: {e.code().name} {details[:500]!r}\nrequest: {request}"[:3000]
        assert len(details.encode()) <= MAX_MESSAGE_BYTES, f"{method.name}: a {len(details):,}-character message"
        return e.code()


def ref(s: StoreResult) -> pb.VariantRef:
    return pb.VariantRef(chunk_key=s.chunk_key, variant_id=s.variant_id)


def test_random_requests_to_every_rpc_get_a_status_for_bad_input_and_lose_nothing(kvserver):
    rng = random.Random(20261205)
    layers = [(torch.randn(1, 4, 4), torch.randn(1, 4, 4)) for _ in range(2)]
    with KVClient(kvserver.address, timeout=20) as c:
        stored = [c.store(MODEL, chunk_tokens(i), layers) for i in range(6)]
        plan = c.plan(MODEL, [chunk_tokens(i) for i in range(3)], question_tokens=5)
        c.release(plan.lease_id)
    known = [s.chunk_key for s in stored] + [s.variant_id for s in stored] + [MODEL, plan.lease_id]
    values = Values(rng, known)
    services = pb.DESCRIPTOR.services_by_name
    methods = {m.name: m for s in services.values() for m in s.methods}
    # (a valid request of the client's own, to change a field or two of)
    templates: dict[str, Callable[[], Message | list[Message]]] = {
        "Plan": lambda: plan_request(MODEL, [chunk_tokens(i) for i in rng.sample(range(8), 3)], 5,
                                     conversation_id=rng.choice(["", "c1"]), policy="query"),
        "Store": lambda: list(store_requests(MODEL, [rng.randrange(1000) for _ in range(4)], layers)),
        "Lookup": lambda: lookup_request(MODEL, chunk_tokens(rng.randrange(8)), None),
        "FetchLayers": lambda: fetch_request([rng.choice(stored).chunk_key]),
        "Lease": lambda: pb.LeaseRequest(variants=[ref(rng.choice(stored))]),
        "Locate": lambda: pb.LocateRequest(variants=[ref(rng.choice(stored))]),
    }
    seen: dict[str, set[str]] = {}
    with grpc.insecure_channel(kvserver.address) as ch:
        for service in ("KVCache", "Admin"):  # Admin's Evict and Flush may drop what the check below reads
            for method in services[service].methods:
                cls = method.input_type._concrete_class
                for _ in range(RANDOM_CALLS):
                    n = rng.choice([0, 1, 2, 3]) if method.client_streaming else 0
                    request = [values.message(cls) for _ in range(n)] if method.client_streaming else values.message(cls)
                    seen.setdefault(method.name, set()).add(call(ch, method, request).name)
            if service == "KVCache":
                for name, make in templates.items():
                    for _ in range(MUTANT_CALLS):
                        request = make()
                        for _ in range(rng.choice([1, 2])):
                            values.mutate(rng.choice(request) if isinstance(request, list) else request)
                        seen.setdefault(name, set()).add(call(ch, methods[name], request).name)
                with KVClient(kvserver.address, timeout=20) as c:  # nothing lost, nothing changed
                    for s in stored:
                        got = c.fetch(s.chunk_key, s.variant_id)
                        for (k, v), (k0, v0) in zip(got, layers, strict=True):
                            assert torch.equal(k, k0) and torch.equal(v, v0), s
    assert kvserver.proc.poll() is None, kvserver.log()[-3000:]
    assert "Traceback" not in kvserver.log()
    # the requests reached past the first checks: these RPCs answered some of them
    for name in ("Plan", "Store", "Lookup", "FetchLayers", "Lease", "Locate", "GetChunk", "ListChunks", "Release"):
        assert "OK" in seen[name], f"{name}: {sorted(seen[name])}"
