"""Co-located Store (StoreLocal): layers through a staging area of shared memory.

Real server process on loopback, real RocksDB and payload files. References are
independent of the path under test: the tensors themselves, the payload file's bytes
against the tensors' bytes, a restart that reads every layer back from disk with the
checksums the service computed verified, and the gRPC Store of the same tensors."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest
import torch

from kvclient import local_store
from kvclient.client import AsyncKVClient, KVClient, store_header
from kvclient.errors import InvalidArgumentError
from kvclient.local_store import StagingMap
from kvcraft.keys import ModelSpec, chunk_key
from kvcraft.v1 import kvcraft_pb2 as pb

MODEL = ModelSpec("staged", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32").fingerprint()
LAYER_BYTES = 2 * 2 * 64 * 64 * 4  # K + V of [2, 64, 64] fp32


def _layers(seed: int, dtype=torch.float32, n: int = 4):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 64, 64, generator=g).to(dtype), torch.randn(2, 64, 64, generator=g).to(dtype))
            for _ in range(n)]


def _tokens(i: int) -> list[int]:
    return [i * 1000 + t for t in range(64)]


def _equal(got, want) -> bool:
    return len(got) == len(want) and all(torch.equal(a, b) and torch.equal(x, y) for (a, x), (b, y) in zip(got, want))


def _payload_bytes(layers) -> bytes:
    return b"".join(k.contiguous().view(torch.uint8).numpy().tobytes() + v.contiguous().view(torch.uint8).numpy().tobytes()
                    for k, v in layers)


def _staging_fds(server) -> list[str]:
    fd_dir = Path(f"/proc/{server.proc.pid}/fd")
    out = []
    for fd in fd_dir.iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if "kvcraft-stage-" in link:
            out.append(link)
    return out


def _tmp_files(server) -> list[Path]:
    return [p for p in (server.data_dir / "payloads").rglob("*.tmp")]


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _nothing_left(server, client: KVClient, tokens: list[int]) -> None:
    """No variant, no open Store counted, no staging area, no temporary payload file."""
    _wait(lambda: client.stats().inflight_stores == 0, "the Store to end on the server")
    assert client.stats().inflight_store_bytes == 0
    assert not client.lookup(chunk_key=chunk_key(MODEL, tokens)).found
    _wait(lambda: not _staging_fds(server), "the staging area to close")
    assert _tmp_files(server) == []


class RawStoreLocal:
    """The StoreLocal protocol by hand (what kvclient.local_store does, step by step)."""

    def __init__(self, address: str, serializer=pb.StoreLocalRequest.SerializeToString) -> None:
        self.channel = grpc.insecure_channel(address)
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        method = self.channel.stream_stream(local_store.STORE_LOCAL, request_serializer=serializer,
                                            response_deserializer=pb.StoreLocalResponse.FromString)
        self.call = method(iter(self.q.get, None), timeout=60)
        self.staging: StagingMap | None = None

    def send(self, msg) -> None:
        self.q.put(msg)

    def header(self, tokens: list[int], layers) -> pb.StagingArea:
        self.send(pb.StoreLocalRequest(header=store_header(MODEL, tokens, layers)))
        area = next(self.call).staging
        self.staging = StagingMap(area)
        return area

    def staged(self, count: int, staging_id: str | None = None) -> None:
        sid = self.staging.area.staging_id if staging_id is None else staging_id
        self.send(pb.StoreLocalRequest(staged=pb.StagedLayers(staging_id=sid, layers=count)))

    def end(self):
        self.q.put(None)
        return next(self.call)

    def close(self) -> None:
        self.q.put(None)
        self.call.cancel()
        if self.staging is not None:
            self.staging.close()
        self.channel.close()


# -- round trips -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_local_store_round_trips_bit_for_bit_through_both_fetch_paths_and_the_disk(start_server, dtype):
    server = start_server(host_budget_bytes=8 << 20)
    want = {i: _layers(i, dtype) for i in range(3)}
    with KVClient(server.address) as c:
        keys = {}
        for i, layers in want.items():
            r = c.store(MODEL, _tokens(i), layers)
            assert r.local and not r.already_present and r.bytes_stored == 4 * LAYER_BYTES // (4 // layers[0][0].element_size())
            keys[i] = r.chunk_key
        again = c.store(MODEL, _tokens(0), want[0])
        assert again.local and again.already_present
        for i, layers in want.items():
            assert _equal(c.fetch(keys[i]), layers)  # gRPC FetchLayers (host tier)
            with c.fetch_local([keys[i]]) as lf:  # shared memory (host slab)
                assert lf.tier == ["host"] and _equal(lf.layers[0], layers)
        # the payload file holds exactly the tensors' bytes, K then V per layer
        files = sorted((server.data_dir / "payloads").rglob("*.kv"))
        assert len(files) == 3
        blobs = {f.read_bytes()[: 4 * want[0][0][0].numel() * want[0][0][0].element_size() * 2] for f in files}
        assert blobs == {_payload_bytes(layers) for layers in want.values()}
        assert _staging_fds(server) == [] and c.stats().inflight_store_bytes == 0
    server.restart()  # the host tier is gone: every layer comes from disk, checksums verified
    with KVClient(server.address) as c:
        for i, layers in want.items():
            assert _equal(c.fetch(keys[i]), layers)


def test_local_and_grpc_stores_of_the_same_tensors_are_the_same_variant(start_server):
    server = start_server()
    layers = _layers(7)
    with KVClient(server.address, local_store=False) as remote, KVClient(server.address) as local:
        a = remote.store(MODEL, _tokens(1), layers)
        b = local.store(MODEL, _tokens(1), layers)
        assert not a.local and b.local and b.already_present and a.variant_id == b.variant_id
        c = local.store(MODEL, _tokens(2), layers)
        d = remote.store(MODEL, _tokens(2), layers)
        assert c.local and not c.already_present and not d.local and d.already_present
        assert _equal(remote.fetch(c.chunk_key), layers)


def test_async_client_stores_through_shared_memory(start_server):
    server = start_server()
    layers = _layers(3, torch.float16)

    async def go():
        async with AsyncKVClient(server.address) as c:
            r = await c.store(MODEL, _tokens(5), layers)
            got = await c.fetch(r.chunk_key)
            return r, got

    r, got = asyncio.run(go())
    assert r.local and _equal(got, layers)


# -- fallback --------------------------------------------------------------------------
def test_client_falls_back_to_the_grpc_stream_when_the_service_has_it_off(start_server):
    server = start_server(local_store=False)
    layers = _layers(2)
    with KVClient(server.address) as c:
        raw = RawStoreLocal(server.address)
        try:
            with pytest.raises(grpc.RpcError) as e:
                raw.header(_tokens(9), layers)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "local_store = false" in e.value.details()
        finally:
            raw.close()
        r = c.store(MODEL, _tokens(1), layers)
        assert not r.local and not c._local_store  # remembered: later stores go straight to gRPC
        assert not c.store(MODEL, _tokens(2), layers).local
        assert _equal(c.fetch(r.chunk_key), layers)

    async def go():
        async with AsyncKVClient(server.address) as c:
            r = await c.store(MODEL, _tokens(3), layers)
            return r, await c.fetch(r.chunk_key)

    r, got = asyncio.run(go())
    assert not r.local and _equal(got, layers)


def test_a_staging_area_of_another_process_namespace_is_refused_and_the_store_goes_over_grpc(start_server):
    """A client that cannot open the staging path (another host or pid namespace: here
    a path naming an fd that is not this Store's area) never writes into it."""
    server = start_server()
    with KVClient(server.address) as c:
        area = pb.StagingArea(staging_id="0" * 32, path=f"/proc/{os.getpid()}/fd/0", length=LAYER_BYTES,
                              layer_bytes=LAYER_BYTES, key_bytes=LAYER_BYTES // 2)
        with pytest.raises(local_store.NotColocated):
            StagingMap(area)
        area.path = "/etc/passwd"
        with pytest.raises(local_store.NotColocated):
            StagingMap(area)


def test_staging_refused_for_room_sends_that_store_over_grpc(start_server):
    """Staging areas count whole payloads in flight: past max_inflight_store_bytes the
    service refuses one, and the client sends that Store as a gRPC stream (counted at
    4 layers) instead."""
    layers = _layers(1, n=8)  # 8 layers x 64 KiB = 512 KiB; 4 layers = 256 KiB
    server = start_server(max_inflight_store_bytes=2 * 8 * LAYER_BYTES + 4 * LAYER_BYTES)
    held = [RawStoreLocal(server.address) for _ in range(2)]
    try:
        for i, raw in enumerate(held):  # two open co-located Stores hold their staging areas
            raw.header(_tokens(100 + i), layers)
        with KVClient(server.address) as c:
            assert c.stats().inflight_store_bytes == 2 * 8 * LAYER_BYTES
            third = RawStoreLocal(server.address)
            try:
                with pytest.raises(grpc.RpcError) as e:
                    third.header(_tokens(200), layers)
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "staging area" in e.value.details() and "max_inflight_store_bytes" in e.value.details()
            finally:
                third.close()
            r = c.store(MODEL, _tokens(3), layers)
            assert not r.local and c._local_store  # this one went over gRPC; the next tries again
            assert _equal(c.fetch(r.chunk_key), layers)
        for raw in held:
            raw.close()
        with KVClient(server.address) as c:
            _wait(lambda: c.stats().inflight_stores == 0, "the held Stores to end")
            assert c.store(MODEL, _tokens(4), layers).local
    finally:
        for raw in held:
            raw.close()


# -- bad input, abandoned and crashed Stores ----------------------------------------------
def _protocol_error(server, c: KVClient, steps, match: str) -> None:
    layers = _layers(4)
    raw = RawStoreLocal(server.address)
    try:
        with pytest.raises(grpc.RpcError) as e:
            steps(raw, layers)
            raw.end()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert match in e.value.details() and "Traceback" not in e.value.details()
    finally:
        raw.close()
    _nothing_left(server, c, _tokens(4))


def _put_all(raw: RawStoreLocal, layers) -> None:
    for i, (k, v) in enumerate(layers):
        raw.staging.put(i, k, v)


@pytest.mark.parametrize("name,steps,match", [
    ("unknown staging id", lambda raw, L: (raw.header(_tokens(4), L), _put_all(raw, L), raw.staged(4, "f" * 32)),
     "is not this Store's"),
    ("past num_layers", lambda raw, L: (raw.header(_tokens(4), L), _put_all(raw, L), raw.staged(5)),
     "staged layers 5: expected 1..4"),
    ("hostile count", lambda raw, L: (raw.header(_tokens(4), L), raw.staged(2**32 - 1)), "staged layers 4294967295"),
    ("backwards", lambda raw, L: (raw.header(_tokens(4), L), _put_all(raw, L), raw.staged(2), raw.staged(2)),
     "staged layers 2: expected 3..4"),
    ("ends early", lambda raw, L: (raw.header(_tokens(4), L), _put_all(raw, L), raw.staged(3)),
     "stream ended after 3 of header.num_layers=4 layers"),
    ("second header", lambda raw, L: (raw.header(_tokens(4), L), raw.send(pb.StoreLocalRequest(
        header=store_header(MODEL, _tokens(4), L)))), "unexpected header message after the header"),
    ("no header", lambda raw, L: (raw.staged(1, "0" * 32), next(raw.call)), "must be a header"),
    ("bad header", lambda raw, L: (raw.send(pb.StoreLocalRequest(header=pb.StoreHeader(model_id=MODEL))),
                                   next(raw.call)), "token_ids is empty"),
])
def test_bad_streams_get_invalid_argument_and_leave_nothing(start_server, name, steps, match):
    server = start_server()
    with KVClient(server.address) as c:
        _protocol_error(server, c, steps, match)


def test_bytes_that_are_not_a_message_get_invalid_argument(start_server):
    server = start_server()
    raw = RawStoreLocal(server.address, serializer=lambda b: b)
    try:
        raw.send(b"\xff\xff\xff")
        with pytest.raises(grpc.RpcError) as e:
            next(raw.call)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid" in e.value.details()
    finally:
        raw.close()


def test_staging_rewritten_after_it_was_staged_is_not_stored(start_server):
    """The client writes layer 0 again after the service wrote it to the payload file:
    the host copy made from the staging area at commit no longer matches the checksum
    the service computed, so the Store fails and nothing is served."""
    server = start_server(host_budget_bytes=8 << 20)
    layers = _layers(4)
    with KVClient(server.address) as c:
        raw = RawStoreLocal(server.address)
        try:
            raw.header(_tokens(4), layers)
            _put_all(raw, layers)
            raw.staged(1)
            _wait(lambda: any(p.stat().st_size >= LAYER_BYTES for p in _tmp_files(server)), "layer 0 in the file")
            raw.staging.put(0, layers[0][0] + 1, layers[0][1])  # written again, after it was staged
            raw.staged(4)
            with pytest.raises(grpc.RpcError) as e:
                raw.end()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "layer 0 of the staging area changed after it was staged" in e.value.details()
        finally:
            raw.close()
        _nothing_left(server, c, _tokens(4))
        assert list((server.data_dir / "payloads").rglob("*.kv")) == []


def test_abandoned_store_leaves_nothing(start_server):
    server = start_server()
    layers = _layers(4)
    with KVClient(server.address) as c:
        raw = RawStoreLocal(server.address)
        raw.header(_tokens(4), layers)
        _put_all(raw, layers)
        raw.staged(2)
        _wait(lambda: any(p.stat().st_size >= 2 * LAYER_BYTES for p in _tmp_files(server)), "2 layers in the file")
        assert len(set(_staging_fds(server))) == 1 and c.stats().inflight_store_bytes == 4 * LAYER_BYTES
        raw.close()  # cancelled mid-store
        _nothing_left(server, c, _tokens(4))
        assert c.store(MODEL, _tokens(4), layers).local  # the same Store afterwards works


_CRASHING_CLIENT = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    from tests.service.test_store_local import RawStoreLocal, _layers, _put_all, _tokens
    raw = RawStoreLocal(sys.argv[1])
    layers = _layers(4)
    raw.header(_tokens(4), layers)
    _put_all(raw, layers)
    raw.staged(2)
    print("staged", flush=True)
    sys.stdin.readline()
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_client_killed_mid_store_leaves_nothing(start_server):
    server = start_server()
    with KVClient(server.address) as c:
        root = Path(__file__).resolve().parents[2]
        client = subprocess.Popen([sys.executable, "-c", _CRASHING_CLIENT, server.address], cwd=root,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
        try:
            assert client.stdout.readline().strip() == "staged"
            _wait(lambda: any(p.stat().st_size >= 2 * LAYER_BYTES for p in _tmp_files(server)), "2 layers in the file")
            assert len(set(_staging_fds(server))) == 1
            client.stdin.write("\n")
            client.stdin.flush()
            assert client.wait(timeout=30) == -signal.SIGKILL
        finally:
            client.kill()
        _nothing_left(server, c, _tokens(4))


def test_service_killed_mid_store_restarts_with_nothing_left(start_server):
    server = start_server()
    layers = _layers(4)
    raw = RawStoreLocal(server.address)
    try:
        raw.header(_tokens(4), layers)
        _put_all(raw, layers)
        raw.staged(3)
        _wait(lambda: any(p.stat().st_size >= 3 * LAYER_BYTES for p in _tmp_files(server)), "3 layers in the file")
        server.kill()
        with pytest.raises(grpc.RpcError) as e:
            raw.end()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        raw.close()
    assert not [p for p in Path("/dev/shm").glob("kvcraft-stage-*")]  # memfds: nothing in any filesystem
    server.start()
    with KVClient(server.address) as c:
        _nothing_left(server, c, _tokens(4))  # the .tmp debris was deleted at start
        r = c.store(MODEL, _tokens(4), layers)
        assert r.local and _equal(c.fetch(r.chunk_key), layers)
