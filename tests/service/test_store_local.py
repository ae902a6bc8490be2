"""Co-located Store (StoreLocal): layers through a staging area of shared memory.

Real server process on loopback, real RocksDB and payload files. References are
independent of the path under test: the tensors themselves, the payload file's bytes
against the tensors' bytes, a restart that reads every layer back from disk with the
checksums the service computed verified, and the gRPC Store of the same tensors."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from kvclient import local_store
from kvclient.client import AsyncKVClient, KVClient, store_header
from kvclient.errors import ResourceExhaustedError
from kvservice.launcher import ServiceProcess
from kvclient.local_store import StagingBuffer
from kvcraft.keys import chunk_key
from kvcraft.v1 import kvcraft_pb2 as pb
from tests.conftest import random_layers
from tests.service.store_local_helpers import LAYER_BYTES, MODEL, MODEL_SHAPE, STAGED, RawStoreLocal, staged_tokens  # noqa: F401 (MODEL_SHAPE: `model`)


def _equal(got, want) -> bool:
    return len(got) == len(want) and all(torch.equal(a, b) and torch.equal(x, y) for (a, x), (b, y) in zip(got, want))


def _payload_bytes(layers) -> bytes:
    return b"".join(k.contiguous().view(torch.uint8).numpy().tobytes() + v.contiguous().view(torch.uint8).numpy().tobytes()
                    for k, v in layers)


def _staging_fds(pid: int) -> list[str]:
    """Staging areas a process holds: descriptors and mappings of kvcraft-stage memfds."""
    out = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if "kvcraft-stage-" in link:
            out.append(link)
    maps = Path(f"/proc/{pid}/maps").read_text()
    return out + [line.split(None, 5)[-1] for line in maps.splitlines() if "kvcraft-stage-" in line]


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
    _wait(lambda: not _staging_fds(server.proc.pid), "the staging area to close")
    assert _tmp_files(server) == []


# -- round trips -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_local_store_round_trips_bit_for_bit_through_both_fetch_paths_and_the_disk(start_server, dtype):
    server = start_server(host_budget_bytes=8 << 20)
    want = {i: random_layers(i, STAGED, 4, dtype) for i in range(3)}
    with KVClient(server.address) as c:
        keys = {}
        for i, layers in want.items():
            r = c.store(MODEL, staged_tokens(i), layers)
            assert r.local and not r.already_present and r.bytes_stored == 4 * LAYER_BYTES // (4 // layers[0][0].element_size())
            keys[i] = r.chunk_key
        again = c.store(MODEL, staged_tokens(0), want[0])
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
        assert c.stats().inflight_store_bytes == 0
        # the service keeps the client's one area mapped for its next Store, nothing else
        assert set(_staging_fds(server.proc.pid)) <= set(_staging_fds(os.getpid()))
        assert len(set(_staging_fds(server.proc.pid))) == 1
    _wait(lambda: not _staging_fds(server.proc.pid), "the service to drop the closed client's area")
    server.restart()  # the host tier is gone: every layer comes from disk, checksums verified
    with KVClient(server.address) as c:
        for i, layers in want.items():
            assert _equal(c.fetch(keys[i]), layers)


def test_local_and_grpc_stores_of_the_same_tensors_are_the_same_variant(shared_server, model):
    layers = random_layers(7, STAGED, 4)
    with KVClient(shared_server.address, local_store=False) as remote, KVClient(shared_server.address) as local:
        a = remote.store(model, staged_tokens(1), layers)
        b = local.store(model, staged_tokens(1), layers)
        assert not a.local and b.local and b.already_present and a.variant_id == b.variant_id
        c = local.store(model, staged_tokens(2), layers)
        d = remote.store(model, staged_tokens(2), layers)
        assert c.local and not c.already_present and not d.local and d.already_present
        assert _equal(remote.fetch(c.chunk_key), layers)


def test_async_client_stores_through_shared_memory(shared_server, model):
    layers = random_layers(3, STAGED, 4, torch.float16)

    async def go():
        async with AsyncKVClient(shared_server.address) as c:
            r = await c.store(model, staged_tokens(5), layers)
            got = await c.fetch(r.chunk_key)
            return r, got

    r, got = asyncio.run(go())
    assert r.local and _equal(got, layers)


# -- fallback --------------------------------------------------------------------------
def test_client_falls_back_to_the_grpc_stream_when_the_service_has_it_off(start_server, caplog):
    server = start_server(local_store=False)
    layers = random_layers(2, STAGED, 4)
    with KVClient(server.address) as c:
        raw = RawStoreLocal(server.address)
        try:
            with pytest.raises(grpc.RpcError) as e:
                raw.start(staged_tokens(9), layers)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "local_store = false" in e.value.details()
        finally:
            raw.close()
        with caplog.at_level(logging.INFO, logger="kvclient.local_store"):
            r = c.store(MODEL, staged_tokens(1), layers)
            assert not r.local and not c.core.local_store  # remembered: later stores go straight to gRPC
            assert not c.store(MODEL, staged_tokens(2), layers).local
        assert _equal(c.fetch(r.chunk_key), layers)
    said = [m.getMessage() for m in caplog.records if m.name == "kvclient.local_store"]
    assert len(said) == 1, said  # once per client, with the service's reason
    assert "declined co-located Stores (FAILED_PRECONDITION" in said[0] and "local_store = false" in said[0]

    async def go():
        async with AsyncKVClient(server.address) as c:
            r = await c.store(MODEL, staged_tokens(3), layers)
            return r, await c.fetch(r.chunk_key)

    r, got = asyncio.run(go())
    assert not r.local and _equal(got, layers)


class OtherPidNamespace(ServiceProcess):
    """The service in a pid namespace of its own (as a container without a shared
    process namespace): the client's /proc/<pid>/fd/<fd> does not exist there."""

    def _launch(self, argv, ready, timeout, **popen):  # noqa: ANN001
        super()._launch(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"] + argv, ready, timeout, **popen)


def test_a_service_in_another_pid_namespace_refuses_and_the_client_falls_back(tmp_path):
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here: {probe.stderr.decode().strip()}")
    server = OtherPidNamespace(tmp_path / "data").start()
    try:
        layers = random_layers(6, STAGED, 4)
        with KVClient(server.address) as c:
            r = c.store(MODEL, staged_tokens(6), layers)
            assert not r.local and not c.core.local_store  # refused once, gRPC from then on
            assert _equal(c.fetch(r.chunk_key), layers)
        assert "Traceback" not in server.log()
    finally:
        server.close()


@pytest.mark.parametrize("name,area,code,match", [
    ("not this Store's id", lambda b: pb.StagingArea(staging_id="f" * 32, pid=os.getpid(), fd=b.fd),
     grpc.StatusCode.FAILED_PRECONDITION, "is not staging area ffff"),
    ("a regular file", lambda b: pb.StagingArea(staging_id=b.staging_id, pid=os.getpid(), fd=0),
     grpc.StatusCode.FAILED_PRECONDITION, "is not staging area"),
    ("no such process", lambda b: pb.StagingArea(staging_id=b.staging_id, pid=2**31, fd=b.fd),
     grpc.StatusCode.FAILED_PRECONDITION, "cannot open the staging area"),
    ("hostile id", lambda b: pb.StagingArea(staging_id="../../etc/passwd", pid=os.getpid(), fd=b.fd),
     grpc.StatusCode.INVALID_ARGUMENT, "is not 32 lowercase hex chars"),
    ("pid 0", lambda b: pb.StagingArea(staging_id=b.staging_id, pid=0, fd=b.fd),
     grpc.StatusCode.INVALID_ARGUMENT, "not a process's descriptor"),
    ("too small", lambda b: _small_area(), grpc.StatusCode.INVALID_ARGUMENT, "the payload needs"),
    ("unsealed", lambda b: _unsealed_area(), grpc.StatusCode.INVALID_ARGUMENT, "not sealed against shrinking"),
])
def test_a_staging_area_the_service_must_not_map_is_refused(start_server, name, area, code, match):
    server = start_server()
    layers = random_layers(4, STAGED, 4)
    buf = StagingBuffer(4 * LAYER_BYTES)
    try:
        with KVClient(server.address) as c:
            raw = RawStoreLocal(server.address)
            try:
                with pytest.raises(grpc.RpcError) as e:
                    raw.start(staged_tokens(4), layers, area=area(buf))
                assert e.value.code() == code and match in e.value.details(), e.value.details()
            finally:
                raw.close()
            _nothing_left(server, c, staged_tokens(4))
    finally:
        buf.close()
        for x in _KEEP:
            x.close() if isinstance(x, StagingBuffer) else os.close(x)
        _KEEP.clear()


_KEEP: list = []  # areas made for one test, open until it ends


def _small_area() -> pb.StagingArea:
    b = StagingBuffer(LAYER_BYTES)
    _KEEP.append(b)
    return b.message()


def _unsealed_area() -> pb.StagingArea:
    sid = "a" * 32
    fd = os.memfd_create(f"kvcraft-stage-{sid}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4 * LAYER_BYTES)
    _KEEP.append(fd)
    return pb.StagingArea(staging_id=sid, pid=os.getpid(), fd=fd)


def test_local_stores_are_counted_in_flight_like_streams(start_server):
    """Each open co-located Store counts 4 layers against max_inflight_store_bytes (the
    staging memory is the client's own); past the budget a Store is refused, naming it."""
    layers = random_layers(1, STAGED, 8)
    server = start_server(max_inflight_store_bytes=2 * 4 * LAYER_BYTES)
    held = [RawStoreLocal(server.address) for _ in range(2)]
    try:
        for i, raw in enumerate(held):
            raw.start(staged_tokens(100 + i), layers)
        with KVClient(server.address) as c:
            assert c.stats().inflight_store_bytes == 2 * 4 * LAYER_BYTES
            with pytest.raises(ResourceExhaustedError, match="max_inflight_store_bytes"):
                c.store(MODEL, staged_tokens(3), layers)
            for raw in held:
                raw.put_all(layers)
                raw.staged(8)
                assert raw.end().WhichOneof("part") == "result"
            assert c.store(MODEL, staged_tokens(3), layers).local
            for i in range(2):
                assert _equal(c.fetch(chunk_key(MODEL, staged_tokens(100 + i))), layers)
    finally:
        for raw in held:
            raw.close()


def test_a_client_keeps_few_staging_areas_and_closes_them(start_server):
    server = start_server()
    c = KVClient(server.address)
    for i in range(5):
        assert c.store(MODEL, staged_tokens(i), random_layers(i, STAGED, 4)).local
    assert len(set(_staging_fds(os.getpid()))) <= local_store.IDLE_AREAS  # reused, not one per Store
    assert set(_staging_fds(server.proc.pid)) <= set(_staging_fds(os.getpid()))  # only this client's areas
    c.close()
    assert not _staging_fds(os.getpid())
    _wait(lambda: not _staging_fds(server.proc.pid), "the service to drop the areas it kept mapped")


# -- bad input, abandoned and crashed Stores ----------------------------------------------
def _protocol_error(server, c: KVClient, steps, match: str) -> None:
    layers = random_layers(4, STAGED, 4)
    raw = RawStoreLocal(server.address)
    try:
        with pytest.raises(grpc.RpcError) as e:
            steps(raw, layers)
            raw.end()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert match in e.value.details() and "Traceback" not in e.value.details()
    finally:
        raw.close()
    _nothing_left(server, c, staged_tokens(4))


@pytest.mark.parametrize("name,steps,match", [
    ("past num_layers", lambda raw, L: (raw.start(staged_tokens(4), L), raw.put_all(L), raw.staged(5)),
     "staged layers 5: expected 1..4"),
    ("hostile count", lambda raw, L: (raw.start(staged_tokens(4), L), raw.staged(2**32 - 1)), "staged layers 4294967295"),
    ("zero", lambda raw, L: (raw.start(staged_tokens(4), L), raw.staged(0)), "staged layers 0: expected 1..4"),
    ("backwards", lambda raw, L: (raw.start(staged_tokens(4), L), raw.put_all(L), raw.staged(2), raw.staged(2)),
     "staged layers 2: expected 3..4"),
    ("ends early", lambda raw, L: (raw.start(staged_tokens(4), L), raw.put_all(L), raw.staged(3)),
     "stream ended after 3 of header.num_layers=4 layers"),
    ("second start", lambda raw, L: (raw.start(staged_tokens(4), L), raw.send(pb.StoreLocalRequest(
        start=pb.StoreLocalStart(header=store_header(MODEL, staged_tokens(4), L))))),
     "unexpected start message after the start"),
    ("no start", lambda raw, L: (raw.staged(1), next(raw.call)), "must be a start"),
    ("bad header", lambda raw, L: (raw.send(pb.StoreLocalRequest(start=pb.StoreLocalStart(
        header=pb.StoreHeader(model_id=MODEL)))), next(raw.call)), "token_ids is empty"),
])
def test_bad_streams_get_invalid_argument_and_leave_nothing(start_server, name, steps, match):
    server = start_server()
    with KVClient(server.address) as c:
        _protocol_error(server, c, steps, match)


def test_bytes_that_are_not_a_message_get_invalid_argument(shared_server):
    raw = RawStoreLocal(shared_server.address, serializer=lambda b: b)
    try:
        raw.send(b"\xff\xff\xff")
        with pytest.raises(grpc.RpcError) as e:
            next(raw.call)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid" in e.value.details()
    finally:
        raw.close()


def _file_has(server, nbytes: int) -> bool:
    return any(p.stat().st_size >= nbytes for p in _tmp_files(server))


def _tiers_agree(server, c: KVClient, key: str):
    """The variant as the host slab (shared memory), FetchLayers and, after a restart,
    the disk (every layer's checksum verified) serve it: returned once all three agree."""
    with c.fetch_local([key]) as lf:
        assert lf.tier == ["host"]
        host = [(k.clone(), v.clone()) for k, v in lf.layers[0]]
    assert _equal(c.fetch(key), host)
    server.restart()
    with KVClient(server.address) as again:
        assert _equal(again.fetch(key), host)  # from disk: checksums verified, no error
    return host


def test_staging_rewritten_after_it_was_staged_changes_nothing(start_server):
    """The client writes layer 0 again after the service took it: the service hashed and
    wrote its own copy, so the payload file, its checksums and the host copy all hold the
    layer as it was staged."""
    server = start_server(host_budget_bytes=8 << 20)
    layers = random_layers(4, STAGED, 4)
    raw = RawStoreLocal(server.address)
    try:
        raw.start(staged_tokens(4), layers)
        raw.put_all(layers)
        raw.staged(1)
        _wait(lambda: _file_has(server, LAYER_BYTES), "layer 0 in the file")
        raw.staging.put(0, layers[0][0] + 1, layers[0][1])  # written again, after it was staged
        raw.staged(4)
        result = raw.end().result
    finally:
        raw.close()
    with KVClient(server.address) as c:
        assert _equal(_tiers_agree(server, c, result.chunk_key), layers)


def test_staging_scribbled_on_during_the_store_is_stored_consistently(start_server):
    """A client that keeps writing its area while the Store runs gets one version of
    each layer stored, the same in the payload file, its checksums and the host copy."""
    server = start_server(host_budget_bytes=8 << 20)
    layers = random_layers(4, STAGED, 4)
    raw = RawStoreLocal(server.address)
    stop = threading.Event()

    def scribble() -> None:
        g = torch.Generator().manual_seed(99)
        while not stop.is_set():
            for i in range(4):
                raw.staging.put(i * LAYER_BYTES, torch.randn(2, 64, 64, generator=g), torch.randn(2, 64, 64, generator=g))

    try:
        raw.start(staged_tokens(4), layers)
        raw.put_all(layers)
        t = threading.Thread(target=scribble)
        t.start()
        try:
            for n in range(1, 5):
                raw.staged(n)
            result = raw.end().result
        finally:
            stop.set()
            t.join()
    finally:
        raw.close()
    with KVClient(server.address) as c:
        _tiers_agree(server, c, result.chunk_key)


def test_abandoned_store_leaves_nothing(start_server):
    server = start_server()
    layers = random_layers(4, STAGED, 4)
    with KVClient(server.address) as c:
        raw = RawStoreLocal(server.address)
        raw.start(staged_tokens(4), layers)
        raw.put_all(layers)
        raw.staged(2)
        _wait(lambda: _file_has(server, 2 * LAYER_BYTES), "2 layers in the file")
        assert _staging_fds(server.proc.pid) and c.stats().inflight_store_bytes == 4 * LAYER_BYTES
        raw.close()  # cancelled mid-store
        _nothing_left(server, c, staged_tokens(4))
        assert c.store(MODEL, staged_tokens(4), layers).local  # the same Store afterwards works


_CRASHING_CLIENT = textwrap.dedent("""
    import os, signal, sys
    from tests.conftest import random_layers
    from tests.service.store_local_helpers import STAGED, RawStoreLocal, staged_tokens
    raw = RawStoreLocal(sys.argv[1])
    layers = random_layers(4, STAGED, 4)
    raw.start(staged_tokens(4), layers)
    raw.put_all(layers)
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
            _wait(lambda: _file_has(server, 2 * LAYER_BYTES), "2 layers in the file")
            assert _staging_fds(server.proc.pid)  # the service maps the dead client's area ...
            client.stdin.write("\n")
            client.stdin.flush()
            assert client.wait(timeout=30) == -signal.SIGKILL
        finally:
            client.kill()
        _nothing_left(server, c, staged_tokens(4))  # ... and lets go of it with the Store


def test_service_killed_mid_store_restarts_with_nothing_left(start_server):
    server = start_server()
    layers = random_layers(4, STAGED, 4)
    raw = RawStoreLocal(server.address)
    try:
        raw.start(staged_tokens(4), layers)
        raw.put_all(layers)
        raw.staged(3)
        _wait(lambda: _file_has(server, 3 * LAYER_BYTES), "3 layers in the file")
        server.kill()
        with pytest.raises(grpc.RpcError) as e:
            raw.end()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        raw.close()
    assert not list(Path("/dev/shm").glob("kvcraft-stage-*"))  # memfds: nothing in any filesystem
    server.start()
    with KVClient(server.address) as c:
        _nothing_left(server, c, staged_tokens(4))  # the .tmp debris was deleted at start
        r = c.store(MODEL, staged_tokens(4), layers)
        assert r.local and _equal(c.fetch(r.chunk_key), layers)
