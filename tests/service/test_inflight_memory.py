"""In-flight Stores do not pile up in RAM (issue 18, item 6): layers stream to their
payload file (and, if admitted, straight into the host slab, whose size is the host
budget for all streams together), so unfinished streams cost the server about the host
budget in all, not a buffered copy each."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from kvclient.client import KVClient, store_requests
from kvcraft.keys import ModelSpec
from kvcraft.v1 import kvcraft_pb2_grpc as pb_grpc

LAYERS = 24
MODEL = ModelSpec("inflight", num_layers=LAYERS, num_kv_heads=4, head_dim=128, dtype="float32").fingerprint()
STREAMS = 4
MiB = 1 << 20


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.xfail(strict=False, reason="issue 18 item 6 still open (a reproduction, run with --runxfail): server RSS grows with the bytes of "
                   "unfinished Store streams (321-649 MiB for 4 x 184 MiB on 2026-11-23, passes now and then); cause not found")
def test_unfinished_stores_cost_at_most_the_host_budget(start_server):
    host_budget = 16 * MiB
    server = start_server(host_budget_bytes=host_budget)
    layer = (torch.ones(4, 2048, 128), torch.ones(4, 2048, 128))  # 8 MiB of K+V per layer
    per_stream = LAYERS * 8 * MiB  # 192 MiB, 184 of them sent before the stream stalls
    with KVClient(server.address) as c:  # warm up: imports, slab, RocksDB
        c.stats()
    rss_before = _rss(server.proc.pid)
    release = threading.Event()
    errors: list[BaseException] = []

    def stalled(i: int) -> None:
        msgs = list(store_requests(MODEL, [i * 10_000 + t for t in range(2048)], [layer] * LAYERS))
        def gen():
            yield from msgs[:-1]
            release.wait(120)
            yield msgs[-1]
        with grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 64 * MiB)]) as ch:
            try:
                pb_grpc.KVCacheStub(ch).Store(gen(), timeout=180)
            except grpc.RpcError as e:
                errors.append(e)

    threads = [threading.Thread(target=stalled, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    payloads = server.data_dir / "payloads"
    deadline = time.monotonic() + 120
    while sum(p.stat().st_size for p in payloads.rglob("*.tmp")) < STREAMS * (per_stream - 8 * MiB):
        assert time.monotonic() < deadline, "the streams did not reach the server"
        time.sleep(0.05)
    grown = _rss(server.proc.pid) - rss_before
    release.set()
    for t in threads:
        t.join(180)
    assert not errors, errors
    # 4 x 184 MiB are in flight; buffered, they would be 736 MiB of RSS. What remains is
    # the slab (the host budget), a few messages per stream inside gRPC and what the
    # allocator keeps: it does not grow with the length of the streams.
    bound = 256 * MiB
    assert grown < bound, f"RSS grew {grown / MiB:.0f} MiB with {STREAMS} stores in flight"
    with KVClient(server.address) as c:
        assert c.stats().variants == STREAMS
