"""A client that closes a FetchLayers stream early: the real service in this process (its
store at hand), on loopback. Leaving early is a normal event: nothing is copied up for
the stream, nothing stays reserved, and nothing is logged as an error."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from kvcraft.v1 import kvcraft_pb2 as pb
from kvcraft.v1 import kvcraft_pb2_grpc as pb_grpc
from kvservice.config import load_config
from kvservice.server.startup import start_server
from kvservice.store import ChunkStore
from tests.service.store_helpers import assert_no_room_reserved, open_store, store_variant

# Layers of 1 MiB, far past HTTP/2's flow-control window: a cancel finds the server
# mid-write, not done with the stream.
LAYERS = 6
TOKENS = 8192
HOST_BYTES = 32 << 20


class Served:
    """`start_server` on its own event loop thread, as `kvcraft serve` runs it."""

    on_disk = ""  # chunk keys of the variants the fixture stored
    in_host = ""

    def __init__(self, root: Path) -> None:
        cfg = load_config(env={}, overrides={"data_dir": str(root), "port": 0, "host_budget_bytes": HOST_BYTES})
        self.loop = asyncio.new_event_loop()
        self.running = self.loop.run_until_complete(start_server(cfg))
        self.thread = threading.Thread(target=self.loop.run_forever, name="served-loop", daemon=True)
        self.thread.start()
        self.address = f"127.0.0.1:{self.running.port}"
        self.store: ChunkStore = self.running.store

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.running.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture
def served(tmp_path: Path):
    """The service over a data dir holding one variant on disk only and one in host memory too."""
    store = open_store(tmp_path / "data", HOST_BYTES)
    on_disk, _ = store_variant(store, 1, LAYERS, TOKENS)
    store.close()
    s = Served(tmp_path / "data")
    s.in_host, _ = store_variant(s.store, 2, LAYERS, TOKENS)  # a Store's commit copies it into the slab
    s.on_disk = on_disk
    yield s
    s.close()


def fetch_request(key: str) -> pb.FetchRequest:
    return pb.FetchRequest(variants=[pb.VariantRef(chunk_key=key)])


def wait_released(store: ChunkStore, key: str, timeout: float = 30.0) -> None:
    """The server learns of the cancel after the client returned: wait (bounded) until
    the stream's hold on the variant is released."""
    (v,) = store.index.variants_of(key)
    deadline = time.monotonic() + timeout
    while v.holds:
        assert time.monotonic() < deadline, "the cancelled fetch never released its variant"
        time.sleep(0.005)


def test_a_fetch_the_client_closes_early_copies_nothing_up(served, monkeypatch):
    """The server's read of layer 2 waits until the server has seen the cancel: loopback's
    socket buffers can take all six layers before a cancel arrives, and a stream the
    server finished rightly commits its copy."""
    cancel_seen = threading.Event()
    read_layer = served.store.read_layer

    def gated(info, layer):
        if layer >= 2:
            cancel_seen.wait(30)
        return read_layer(info, layer)

    monkeypatch.setattr(served.store, "read_layer", gated)
    with grpc.insecure_channel(served.address) as ch:
        call = pb_grpc.KVCacheStub(ch).FetchLayers(fetch_request(served.on_disk))
        next(call)  # layer 0, read from disk (and into the host copy being filled)
        call.cancel()
    deadline = time.monotonic() + 30
    while served.running.inflight.active:  # the handler ended: the server saw the cancel
        assert time.monotonic() < deadline, "the server never saw the cancel"
        time.sleep(0.005)
    cancel_seen.set()
    wait_released(served.store, served.on_disk)
    (v,) = served.store.index.variants_of(served.on_disk)
    assert v.tier == "disk"
    (stored,) = served.store.index.variants_of(served.in_host)
    assert_no_room_reserved(served.store.tiers[0], committed=stored.size_bytes)


def test_fetches_the_client_closes_early_release_their_holds_and_log_no_error(served, caplog):
    """Many streams, from the host slab (messages built on the event loop) and from disk,
    closed after a random number of messages while the server writes the next: the race
    in which grpcio's write fails before it has seen the cancel must not log an error.
    The clients are blocking ones on threads: a grpc.aio client on a second event loop in
    the server's process makes grpcio log spurious BlockingIOErrors of its own (both loops
    read its one completion queue's socket: grpc/grpc#25364), which this test would count."""
    rng = random.Random(3)

    def one(stub: pb_grpc.KVCacheStub, key: str, after: int) -> None:
        call = stub.FetchLayers(fetch_request(key))
        for _ in range(after):
            next(call)
        call.cancel()

    def run() -> None:
        with ThreadPoolExecutor(8) as pool:
            for _ in range(30):
                with grpc.insecure_channel(served.address) as ch:
                    stub = pb_grpc.KVCacheStub(ch)
                    draws = [(rng.choice((served.in_host, served.on_disk)), rng.randint(1, LAYERS - 1))
                             for _ in range(8)]
                    for f in [pool.submit(one, stub, *d) for d in draws]:
                        f.result()

    with caplog.at_level(logging.DEBUG):
        run()
        for key in (served.in_host, served.on_disk):
            wait_released(served.store, key)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    with grpc.insecure_channel(served.address) as ch:  # still serving
        assert len(list(pb_grpc.KVCacheStub(ch).FetchLayers(fetch_request(served.on_disk)))) == LAYERS
