"""SIGTERM drain on the real server: health turns NOT_SERVING while new connections are
still accepted, and a Store already running finishes."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvclient.client import KVClient, store_requests
from kvcraft.keys import ModelSpec
from kvcraft.v1 import kvcraft_pb2_grpc as pb_grpc
from tests.conftest import wait_for

MODEL = ModelSpec("drain", num_layers=3, num_kv_heads=1, head_dim=4, dtype="float32").fingerprint()
LAYERS = [(torch.full((1, 5, 4), float(i)), torch.full((1, 5, 4), -float(i))) for i in range(3)]


def _health(address: str) -> int:
    """Health on a fresh connection, as a load balancer's probe makes it."""
    with grpc.insecure_channel(address) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        except grpc.RpcError as e:
            return -e.code().value[0]  # e.g. connection refused: UNAVAILABLE


def test_sigterm_reports_not_serving_and_lets_a_running_store_finish(start_server):
    server = start_server(drain_s=30)
    release = threading.Event()
    result: dict = {}

    def slow_requests():
        msgs = list(store_requests(MODEL, [1, 2, 3, 4, 5], LAYERS))
        yield from msgs[:2]  # header, layer 0
        release.wait(30)
        yield from msgs[2:]

    def run_store() -> None:
        with grpc.insecure_channel(server.address) as ch:
            try:
                result["ok"] = pb_grpc.KVCacheStub(ch).Store(slow_requests(), timeout=60)
            except grpc.RpcError as e:
                result["error"] = e

    t = threading.Thread(target=run_store)
    t.start()
    payloads = server.data_dir / "payloads"
    wait_for(lambda: list(payloads.rglob("*.tmp")), "the Store to reach the server")
    server.proc.send_signal(signal.SIGTERM)
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    wait_for(lambda: _health(server.address) == not_serving, "health NOT_SERVING on a new connection")
    # ... and it stays so, on new connections, for as long as the drain lasts (the
    # Store is still open), instead of the listener closing ("connection refused").
    assert [_health(server.address) for _ in range(10)] == [not_serving] * 10
    release.set()
    t.join(60)
    assert "error" not in result, result.get("error")
    assert result["ok"].bytes_stored == 3 * 2 * 5 * 4 * 4
    assert server.proc.wait(30) == 0
    server.start()
    with KVClient(server.address) as c:
        fetched = c.fetch(result["ok"].chunk_key)
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(fetched, LAYERS))


def test_an_idle_plan_stream_does_not_hold_up_the_drain(start_server):
    """A PlanStream call lives as long as its client: only a request being planned counts
    as running, so SIGTERM stops a server whose streams are idle well before drain_s."""
    import asyncio

    from kvclient.client import AsyncKVClient

    server = start_server(drain_s=60)

    async def run() -> float:
        async with AsyncKVClient(server.address) as c:
            plan = await c.plan(MODEL, [[1, 2, 3]], question_tokens=2)  # the stream is open now
            assert list(plan.order)
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(server.proc.wait, 60)
            return time.monotonic() - t0

    assert asyncio.run(run()) < 30  # far below drain_s: the idle stream was not waited for
    assert server.proc.returncode == 0
