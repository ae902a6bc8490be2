"""In-flight Stores are bounded: an open Store stream writes each layer
to its payload file only (the host slab gets its copy at commit), so it holds about the
layer it is receiving; the server counts each open stream at INFLIGHT_LAYERS layers
against max_inflight_store_bytes and refuses a Store beyond it with RESOURCE_EXHAUSTED.

Four streams of 8 MiB layers stall one layer short of the end (184 of 192 MiB sent
each). Before this bound the server's RSS grew by 250-650 MiB with them (grpcio's
receive windows grew with BDP probing, and the host slab filled with unfinished
payloads); now it grows by about what the streams are counted at."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from kvclient.client import KVClient, Ref, store_requests
from kvclient.errors import ResourceExhaustedError
from kvcraft.keys import ModelSpec
from kvcraft.v1 import kvcraft_pb2_grpc as pb_grpc
from kvservice.store.session import INFLIGHT_LAYERS

LAYERS = 24
MODEL = ModelSpec("inflight", num_layers=LAYERS, num_kv_heads=4, head_dim=128, dtype="float32").fingerprint()
STREAMS = 4
TOKENS = 2048
MiB = 1 << 20
LAYER_BYTES = 2 * 4 * TOKENS * 128 * 4  # K + V of one layer: 8 MiB
COUNTED = INFLIGHT_LAYERS * LAYER_BYTES  # what one open stream is counted at
MARGIN = 96 * MiB  # allocator and grpcio slack beyond what the streams are counted at


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM", "RssShmem"):
            out[name] = int(rest.split()[0]) * 1024
    return out


def _layers(i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Stream i's payload: every layer different, so a fetch proves the right bytes."""
    g = torch.Generator().manual_seed(i)
    base = torch.randn(4, TOKENS, 128, generator=g)
    return [(base + layer, base - layer) for layer in range(LAYERS)]


def _tokens(i: int) -> list[int]:
    return [i * 10_000 + t for t in range(TOKENS)]


def test_inflight_stores_are_bounded_refused_beyond_the_budget_and_lose_nothing(start_server):
    budget = STREAMS * COUNTED  # room for exactly the four stalled streams
    server = start_server(host_budget_bytes=256 * MiB, max_inflight_store_bytes=budget)
    with KVClient(server.address) as c:  # warm up: imports, slab, RocksDB
        c.stats()
    before = _status(server.proc.pid)
    release = threading.Event()
    errors: list[BaseException] = []

    def stalled(i: int) -> None:
        def gen():  # built lazily: the test process holds a message at a time
            for n, msg in enumerate(store_requests(MODEL, _tokens(i), _layers(i))):
                if n == LAYERS:  # the header plus LAYERS - 1 layers are out
                    release.wait(120)
                yield msg

        with grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 64 * MiB)]) as ch:
            try:
                pb_grpc.KVCacheStub(ch).Store(gen(), timeout=180)
            except grpc.RpcError as e:
                errors.append(e)

    threads = [threading.Thread(target=stalled, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    try:
        payloads = server.data_dir / "payloads"
        deadline = time.monotonic() + 120
        while sum(p.stat().st_size for p in payloads.rglob("*.tmp")) < STREAMS * (LAYERS - 1) * LAYER_BYTES:
            assert time.monotonic() < deadline, "the streams did not reach the server"
            assert not errors, errors
            time.sleep(0.05)
        with KVClient(server.address) as c:
            stats = c.stats()
            assert (stats.inflight_stores, stats.inflight_store_bytes) == (STREAMS, budget)
            # A fifth Store does not fit: refused at its header, naming the limit.
            with pytest.raises(ResourceExhaustedError, match="max_inflight_store_bytes"):
                c.store(MODEL, _tokens(STREAMS), _layers(STREAMS)[:1] * LAYERS)
        during = _status(server.proc.pid)
    finally:
        release.set()
        for t in threads:
            t.join(180)
    assert not errors, errors

    # 4 x 184 MiB were in flight: buffered, they would be 736 MiB of RSS. The server grew
    # by about what the streams are counted at, at its peak too, and no unfinished
    # payload sat in the host slab.
    grown = during["VmRSS"] - before["VmRSS"]
    peak = during["VmHWM"] - before["VmHWM"]
    assert grown < budget + MARGIN, f"RSS grew {grown / MiB:.0f} MiB with {STREAMS} stores in flight"
    assert peak < budget + MARGIN, f"peak RSS grew {peak / MiB:.0f} MiB with {STREAMS} stores in flight"
    assert during["RssShmem"] - before["RssShmem"] < 16 * MiB, "unfinished payloads went into the host slab"

    with KVClient(server.address) as c:
        stats = c.stats()
        assert (stats.inflight_stores, stats.inflight_store_bytes) == (0, 0)
        assert stats.variants == STREAMS
        variants = [c.lookup(MODEL, _tokens(i)).variants[0] for i in range(STREAMS)]
        # The host slab got its copies at commit (room for one 192 MiB variant); asked
        # before the fetches below, which promote what they read.
        assert "host" in [v.tier for v in variants], [v.tier for v in variants]
        for i, v in enumerate(variants):
            fetched = list(c.fetch_layers([Ref(v.chunk_key, v.variant_id)]))
            assert len(fetched) == LAYERS
            for f, (k, val) in zip(fetched, _layers(i)):
                assert torch.equal(f.key.view(torch.int32), k.view(torch.int32))  # bit-identical
                assert torch.equal(f.value.view(torch.int32), val.view(torch.int32))
