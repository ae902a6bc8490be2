"""Seeded fuzzing of every RPC against the real server.

A few thousand requests: valid ones, ones with a field set to an extreme value (NaN,
inf, huge, empty, too long, not hex), and byte-level damage of valid messages (flips,
cuts, insertions), to every RPC of the proto. Whatever arrives, the server answers with a
status that names a client problem or success, in a bounded message: never INTERNAL or
UNKNOWN, never a hang, no traceback in its log. Afterwards every variant stored before the
fuzz that is still held reads back bit for bit, no lease or hold is left behind (every
variant can be flushed once the leases the fuzz received are released) and the server's RSS
is back within a bound.
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import grpc
import pytest
import torch
from google.protobuf.descriptor import FieldDescriptor as FD

from kvclient.client import KVClient, store_requests
from kvclient.errors import NotFoundError
from kvcraft.keys import ModelSpec, chunk_key
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.server.status import MAX_MESSAGE_BYTES

SEED = int(os.environ.get("KVCRAFT_FUZZ_SEED", "1823"))
REQUESTS = int(os.environ.get("KVCRAFT_FUZZ_REQUESTS", "3000"))
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
RSS_BOUND_BYTES = 128 << 20  # growth allowed over the fuzz (allocator slack, caches)

LAYERS, HEADS, DIM = 2, 1, 4
MODEL = ModelSpec("fuzz", LAYERS, HEADS, DIM, "float32").fingerprint()
KV = "/kvcraft.v1.KVCache/"
ADMIN = "/kvcraft.v1.Admin/"

FLOATS = [math.nan, math.inf, -math.inf, 1e30, -1.0, 0.0, 1e-30, 3.5, 1e300]
UINT32 = [0, 1, 7, 1000, 2**31, 2**32 - 1]
STRINGS = ["", "x", "0" * 32, "Z" * 32, "é" * 20, "../../etc/passwd", "f" * 1000]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Fuzzer:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.keys: list[str] = []  # chunk keys stored
        self.vids: list[str] = []
        self.lease_ids: list[str] = []

    # -- valid requests, pointing at stored data most of the time ------------------------
    def tokens(self) -> list[int]:
        r = self.rng
        base = r.randrange(40)
        return [base * 10 + t for t in range(r.choice([4, 4, 6]))]

    def key(self) -> str:
        r = self.rng
        if self.keys and r.random() < 0.8:
            return r.choice(self.keys)
        return chunk_key(MODEL, self.tokens())

    def ref(self) -> pb.VariantRef:
        r = self.rng
        ref = pb.VariantRef(chunk_key=self.key())
        if self.vids and r.random() < 0.3:
            ref.variant_id = r.choice(self.vids)
        if r.random() < 0.5:
            ref.cfo = r.random()
        return ref

    def store(self) -> list[pb.StoreRequest]:
        r = self.rng
        toks = self.tokens()
        prefix = [self.key()] if r.random() < 0.3 else []
        g = torch.Generator().manual_seed(r.randrange(1 << 30))
        layers = [(torch.randn(HEADS, len(toks), DIM, generator=g), torch.randn(HEADS, len(toks), DIM, generator=g))
                  for _ in range(LAYERS)]
        return list(store_requests(MODEL, toks, layers, prefix_keys=prefix))

    def valid(self, method: str) -> object:
        r = self.rng
        if method == "Plan":
            chunks = [pb.PlanChunk(token_ids=self.tokens()) if r.random() < 0.5
                      else pb.PlanChunk(chunk_key=self.key(), token_count=4) for _ in range(r.randint(1, 5))]
            req = pb.PlanRequest(model_id=MODEL, chunks=chunks, question_tokens=r.randint(0, 64),
                                 conversation_id=r.choice(["", "c1", "c2"]), lease_ttl_s=r.choice([0.0, 5.0]))
            if r.random() < 0.3:
                req.timings.loads.add(tier=r.choice(["host", "disk"]), bytes_per_layer=4096.0 * r.randint(1, 9),
                                      seconds=1e-4 * r.randint(1, 9))
                req.timings.computes.add(tokens_per_layer=float(r.randint(1, 500)), seconds=1e-4 * r.randint(1, 9))
            return req
        if method == "Store":
            return self.store()
        if method == "PlanStream":
            return [self.valid("Plan") for _ in range(r.randint(1, 4))]
        if method == "FetchLayers":
            return pb.FetchRequest(variants=[self.ref() for _ in range(r.randint(1, 3))],
                                   first_layer=r.choice([0, 0, 1]), num_layers=r.choice([0, 1]))
        if method == "Lookup":
            if r.random() < 0.5:
                return pb.LookupRequest(chunk_key=self.key())
            return pb.LookupRequest(tokens=pb.ChunkTokens(model_id=MODEL, token_ids=self.tokens()))
        if method == "MatchPrefix":
            return pb.MatchPrefixRequest(variant_ids=r.sample(self.vids, min(len(self.vids), r.randint(0, 3))))
        if method == "Locate":
            return pb.LocateRequest(variants=[self.ref() for _ in range(r.randint(1, 2))], lease_ttl_s=r.choice([0.0, 5.0]))
        if method == "Lease":
            return pb.LeaseRequest(variants=[self.ref() for _ in range(r.randint(1, 3))], ttl_s=r.choice([0.0, 5.0]))
        if method == "Release":
            lid = r.choice(self.lease_ids) if self.lease_ids and r.random() < 0.5 else os.urandom(16).hex()
            return pb.ReleaseRequest(lease_id=lid)
        if method == "Stats":
            return pb.StatsRequest()
        if method == "ListChunks":
            return pb.ListChunksRequest(model_id=r.choice(["", MODEL]), page_size=r.choice([0, 3, 1000]),
                                        page_token=r.choice(["", self.key()]))
        if method == "GetChunk":
            return pb.GetChunkRequest(chunk_key=self.key())
        if method in ("Evict", "Pin", "Unpin"):
            if self.vids and r.random() < 0.3:
                return pb.VariantSelector(variant_id=r.choice(self.vids))
            return pb.VariantSelector(chunk_key=self.key())
        if method == "Flush":
            return pb.FlushRequest()
        if method == "Config":
            return pb.ConfigRequest()
        raise AssertionError(method)

    # -- mutations ----------------------------------------------------------------------
    def extreme(self, f: FD) -> object:
        r = self.rng
        t = f.type
        if t in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
            return r.choice(FLOATS)
        if t in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
            return r.choice(UINT32)
        if t in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
            return r.choice([0, 2**64 - 1, 2**40])
        if t in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
            return r.choice([-(2**63), 2**63 - 1, -1])
        if t in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32, FD.TYPE_ENUM):
            return r.choice([-1, 0, 1, 2, 3, 99, 2**31 - 1])
        if t == FD.TYPE_BOOL:
            return r.random() < 0.5
        if t == FD.TYPE_STRING:
            return r.choice(STRINGS)
        if t == FD.TYPE_BYTES:
            return os.urandom(r.choice([0, 1, 17, 64, 200]))
        raise AssertionError(t)

    def mutate_fields(self, msg) -> None:
        """Set one (possibly nested) field to an extreme value, or blow up a repeated one."""
        r = self.rng
        fields = list(msg.DESCRIPTOR.fields)
        if not fields:
            return
        f = r.choice(fields)
        if f.type == FD.TYPE_MESSAGE:
            if f.is_repeated:
                items = getattr(msg, f.name)
                if len(items) and r.random() < 0.7:
                    self.mutate_fields(r.choice(items))
                else:
                    for _ in range(r.choice([0, 1, 300])):
                        items.add()
            else:
                self.mutate_fields(getattr(msg, f.name))
            return
        if f.is_repeated:
            items = getattr(msg, f.name)
            if r.random() < 0.3:
                del items[:]
            else:
                n = r.choice([1, 5, 2000, 70000 if f.type != FD.TYPE_STRING else 3000])
                value = self.extreme(f)
                items.extend([value] * n)
            return
        setattr(msg, f.name, self.extreme(f))

    def damage_bytes(self, data: bytes) -> bytes:
        r = self.rng
        b = bytearray(data)
        kind = r.randrange(4)
        if kind == 0 and b:
            for _ in range(r.randint(1, 4)):
                b[r.randrange(len(b))] = r.randrange(256)
        elif kind == 1 and b:
            del b[r.randrange(len(b)):]
        elif kind == 2:
            at = r.randrange(len(b) + 1)
            b[at:at] = os.urandom(r.randint(1, 16))
        else:
            b = bytearray(os.urandom(r.randint(0, 64)))
        return bytes(b)

    def request_bytes(self, method: str) -> list[bytes]:
        """One request (a list of messages for Store), valid or mutated."""
        r = self.rng
        msgs = self.valid(method)
        msgs = msgs if isinstance(msgs, list) else [msgs]
        roll = r.random()
        if roll < 0.35:
            return [m.SerializeToString() for m in msgs]
        i = r.randrange(len(msgs))
        if roll < 0.75:
            for _ in range(r.randint(1, 3)):
                self.mutate_fields(msgs[i])
            out = [m.SerializeToString() for m in msgs]
        else:
            out = [m.SerializeToString() for m in msgs]
            out[i] = self.damage_bytes(out[i])
        if len(out) > 1 and r.random() < 0.2:  # a stream missing or repeating a message
            j = r.randrange(len(out))
            out = out[:j] + out[j + 1:] if r.random() < 0.5 else out[:j] + [out[j]] + out[j:]
        return out


METHODS = {  # method -> (service path, streaming kind), weighted by how often it is sent
    "Plan": (KV, "uu", 3), "PlanStream": (KV, "ss", 2), "Store": (KV, "su", 3), "FetchLayers": (KV, "us", 3), "Lookup": (KV, "uu", 2),
    "MatchPrefix": (KV, "uu", 1), "Locate": (KV, "uu", 2), "Lease": (KV, "uu", 2), "Release": (KV, "uu", 2),
    "Stats": (ADMIN, "uu", 1), "ListChunks": (ADMIN, "uu", 1), "GetChunk": (ADMIN, "uu", 1),
    "Evict": (ADMIN, "uu", 1), "Pin": (ADMIN, "uu", 1), "Unpin": (ADMIN, "uu", 1), "Flush": (ADMIN, "uu", 0.1),
    "Config": (ADMIN, "uu", 0.3),
}
# StoreLocal's requests name staging areas of shared memory: tests/service/test_store_local.py
# sends it hostile ones (another id, a regular file, unsealed, too small, hostile values).
NOT_FUZZED = {"StoreLocal"}
RESPONSE = {"Plan": pb.PlanResponse, "Locate": pb.LocateResponse, "Lease": pb.LeaseResponse,
            "Store": pb.StoreResponse}


def test_every_rpc_of_the_proto_is_fuzzed():
    rpcs = {m.name for service in pb.DESCRIPTOR.services_by_name.values() for m in service.methods}
    assert rpcs == set(METHODS) | NOT_FUZZED


@pytest.mark.timeout(600)
def test_fuzzed_requests_never_crash_leak_or_answer_internal(start_server):
    server = start_server(host_budget_bytes=1 << 20, disk_budget_bytes=8 << 20, max_chunk_tokens=4096)
    rng = random.Random(SEED)
    fz = Fuzzer(rng)
    with KVClient(server.address) as c:
        for i in range(12):  # tokens no Store of the fuzz sends: a variant of them evicted stays gone
            toks = [1_000_000 + 10 * i + t for t in range(4)]
            res = c.store(MODEL, toks, [(torch.zeros(HEADS, len(toks), DIM), torch.ones(HEADS, len(toks), DIM))] * LAYERS)
            fz.keys.append(res.chunk_key)
            fz.vids.append(res.variant_id)
    before = list(zip(fz.keys, fz.vids))  # each stored as zeros (K) and ones (V)
    rss_before = rss_bytes(server.proc.pid)

    names = list(METHODS)
    weights = [METHODS[m][2] for m in names]
    bad: list[str] = []
    counts: dict[str, int] = {}
    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(server.address, options=opts) as ch:
        for n in range(REQUESTS):
            method = rng.choices(names, weights)[0]
            prefix, kind, _ = METHODS[method]
            data = fz.request_bytes(method)
            path = prefix + method
            try:
                if kind == "uu":
                    out = ch.unary_unary(path)(data[0], timeout=30)
                elif kind == "su":
                    out = ch.stream_unary(path)(iter(data), timeout=30)
                elif kind == "ss":  # one answer per request, a refusal inside the stream
                    answers = [pb.PlanStreamResponse.FromString(a) for a in ch.stream_stream(path)(iter(data), timeout=30)]
                    if len(answers) != len(data):
                        bad.append(f"#{n} {method}: {len(answers)} answers to {len(data)} requests")
                    for a in answers:
                        if a.WhichOneof("result") == "error":
                            status = next(c for c in grpc.StatusCode if c.value[0] == a.error.code)
                            if status not in ALLOWED:
                                bad.append(f"#{n} {method}: {status.name} {a.error.message!r}")
                            counts[f"{method} {status.name}"] = counts.get(f"{method} {status.name}", 0) + 1
                        elif a.plan.lease_id:
                            fz.lease_ids.append(a.plan.lease_id)
                    out = None
                else:
                    out = b"".join(list(ch.unary_stream(path)(data[0], timeout=30))[:1])
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code, out = e.code(), None
                if code not in ALLOWED:
                    bad.append(f"#{n} {method}: {code.name} {e.details()!r} for {[d[:80] for d in data]!r}")
                if len((e.details() or "").encode()) > MAX_MESSAGE_BYTES:
                    bad.append(f"#{n} {method}: a {len(e.details()):,}-character message")
            counts[f"{method} {code.name}"] = counts.get(f"{method} {code.name}", 0) + 1
            if out is not None and method in RESPONSE:
                resp = RESPONSE[method].FromString(out)
                if method == "Store":
                    fz.keys.append(resp.chunk_key)
                    fz.vids.append(resp.variant_id)
                elif resp.lease_id:
                    fz.lease_ids.append(resp.lease_id)
    assert not bad, "\n".join(bad[:20])
    # The mutations reached the checks: most kinds of outcome happened.
    assert sum(v for k, v in counts.items() if k.endswith(" OK")) > REQUESTS // 5, counts
    assert sum(v for k, v in counts.items() if k.endswith(" INVALID_ARGUMENT")) > REQUESTS // 10, counts

    with KVClient(server.address) as c:
        kept = 0
        for key, vid in before:
            try:
                layers = c.fetch(key, vid)
            except NotFoundError:  # the fuzz's Evict and Flush drop some
                continue
            assert all(not k.any() and bool((v == 1).all()) for k, v in layers), f"variant {vid} changed"
            kept += 1
        assert kept, "the fuzz dropped every variant: nothing was read back"
        for lid in fz.lease_ids:
            c.release(lid)
        assert c.stats().leases == 0
        page = c.list_chunks(page_size=1000)
        for s in page.chunks:
            c.unpin(chunk_key=s.chunk_key)
        flushed = c.flush()
        assert flushed.skipped_protected == 0, "a hold or lease outlived its request"
        assert c.stats().variants == 0
    log = server.log()
    assert "Traceback" not in log, log[-3000:]
    rss_after = rss_bytes(server.proc.pid)
    assert rss_after - rss_before < RSS_BOUND_BYTES, (rss_before, rss_after)
    assert server.stop() == 0
