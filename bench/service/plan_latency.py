"""Plan latency, in process and over gRPC on loopback, with N variants stored.

The server runs in its own process (its own GIL, uvloop, as `kvcraft serve` runs it). Variants are
metadata only (a Plan reads the index, never a payload): that process puts records straight
into the store's index, the one the planner reads, so a million of them need no payload files.
Everything a Plan touches is real: the planner, the lease on the reused variants, the
gRPC round trip. The server process also times the planner in process, and reports its
peak RSS (the index's memory) and the time to fill it. In-process latency is also given
as the planning thread's CPU time, which a busy shared machine does not inflate with
waits for a core (the wall-clock p99 there is mostly scheduling).

Columns: "planner" is `Planner.plan` alone; "service" is the whole Plan RPC's core in
process (`PlanningService.plan`: request checks, planner, lease, PlanResponse built),
also timed with 10,000 leases held (as engines that died holding them leave behind);
over loopback from the benchmark's process: "unary" is the Plan RPC (a stub call),
"KVClient" is `KVClient.plan` and "AsyncKVClient" `AsyncKVClient.plan`, each over its
one long-lived PlanStream call; "floor" is a loopback unary call that does nothing (the
gRPC health check on the same server and channel): what grpcio itself costs here, the
limit the unary Plan is compared with in the same run. The four take turns in blocks of
BLOCK requests (the leases released after each block, as an engine releases once its
request is done), so each meets the others' traffic only at block edges, not between two
of its calls, and all of them the machine's slow and fast moments. "calib" is how fast
this machine ran plain Python meanwhile: the CPU time of a fixed loop (scaled to 2M
additions), sampled after every 250 planner calls in the server process; the median, and
the slowest sample over the fastest ("spread"). On the shared 2-core VM it swings by up
to 2x within seconds, and the latency columns with it.

    kvcraft bench plan-latency --sizes 10000 100000 1000000 --requests 2000
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing as mp
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from typing import Sequence

from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbench import results, stats
from kvbench.common.args import count
from kvclient.client import AsyncKVClient, KVClient, plan_request
from kvcraft.keys import ModelSpec, chunk_key, variant_id
from kvcraft.layout import layer_layout
from kvcraft.records import Ref, VariantStats
from kvcraft.v1 import kvcraft_pb2 as pb
from kvcraft.v1 import kvcraft_pb2_grpc as pb_grpc
from kvservice.config import load_config
from kvservice.index import Spec, Variant
from kvservice.planner import ChunkRef
from kvservice.server import RunningServer, start_server

MODEL = ModelSpec("llama3-8b", 32, 8, 128, "bfloat16", 500000.0).fingerprint()
TOKENS = 512
LAYERS = 32
HELD_LEASES = 10_000
BLOCK = 100  # client calls of one kind in a row (the kinds take turns, in rotating order)


def _fill(running: RunningServer, n_variants: int, seed: int) -> list[str]:
    """n_variants metadata records: chunks with 1..4 variants behind random prefixes."""
    rng = random.Random(seed)
    index = running.store.index
    spec = index.intern_spec(Spec(pb.BFLOAT16, (8, TOKENS, 128)))
    layout = index.intern_layout(layer_layout(spec, spec, TOKENS))
    order = range(TOKENS)
    checksums = tuple(range(LAYERS))
    disk = running.store.tiers[-1].name
    keys: list[str] = []
    made = 0
    while made < n_variants:
        key = chunk_key(MODEL, [len(keys), 7, 7])
        keys.append(key)
        for m in range(min(rng.randint(1, 4), n_variants - made)):
            prefix = () if m == 0 else (index.intern_key(keys[rng.randrange(len(keys))]),)
            stats = VariantStats(a=rng.random() * 0.3 if prefix else 0.0, b=0.3 + rng.random() * 0.5,
                                 prefix_attention=(0.2,) * len(prefix))
            index.add(Variant(variant_id(key, prefix), key, prefix, TOKENS, disk, stats, order, model_id=MODEL,
                              num_layers=LAYERS, key_spec=spec, value_spec=spec, layout=layout,
                              layer_checksums=checksums))
            made += 1
    return keys


def _requests(keys: list[str], n: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    hot = keys[: max(50, len(keys) // 100)]  # Zipf-ish: most retrievals hit a hot set
    return [[rng.choice(hot) if rng.random() < 0.6 else rng.choice(keys) for _ in range(5)] for _ in range(n)]


CALIB_EVERY = 250  # planner calls between two calibration samples (0.4% of them follow one)


def _calibration_sample_ms() -> float:
    """CPU ms of a fixed loop of plain Python (100k additions), scaled to 2M."""
    c = time.thread_time()
    total = 0
    for i in range(100_000):
        total += i
    return (time.thread_time() - c) * 20e3


def _service_cpu(running: RunningServer, reqs: list[list[str]]) -> list[float]:
    """Thread CPU time of `PlanningService.plan` per request (each lease released after)."""
    service = running.store.listeners[0]
    out = []
    for r in reqs:
        req = plan_request(MODEL, [(k, TOKENS) for k in r], 64)
        c = time.thread_time()
        resp = service.plan(req)
        out.append(time.thread_time() - c)
        if resp.lease_id:
            running.store.release(resp.lease_id)
    return out


def _serve(n_variants: int, n_requests: int, seed: int, conn) -> None:  # noqa: ANN001 (a Connection)
    """The server process: fill, time the planner in process, serve until told to stop."""

    async def run() -> None:
        with tempfile.TemporaryDirectory(prefix="kvcraft-planlat-") as tmp:
            # host budget of 1 byte: Plan's preload skips the metadata-only variants (no payload to read)
            cfg = load_config(env={}, overrides={"port": 0, "data_dir": tmp, "max_variants": 10 * n_variants,
                                                 "host_budget_bytes": 1})
            running = await start_server(cfg)
            t0 = time.perf_counter()
            gc.disable()  # as recovery does: else collections rescan the growing index (docs/operations.md)
            keys = _fill(running, n_variants, seed)
            gc.enable()
            fill_s = time.perf_counter() - t0
            reqs = _requests(keys, n_requests, seed + 1)
            planner = running.store.listeners[0].planner
            running.heap.freeze()  # as `kvcraft serve` does once its index is recovered
            in_proc, in_proc_cpu, calib = [], [], []
            for i, r in enumerate(reqs):
                if i % CALIB_EVERY == 0:
                    calib.append(_calibration_sample_ms())
                s, c = time.perf_counter(), time.thread_time()
                planner.plan(MODEL, "", [ChunkRef(k, TOKENS) for k in r], 64)
                in_proc_cpu.append(time.thread_time() - c)
                in_proc.append(time.perf_counter() - s)
            svc_cpu = _service_cpu(running, reqs)
            # The same again with HELD_LEASES leases outstanding, as engines that died
            # holding them leave behind until their ttl.
            held = [running.store.take_lease([Ref(keys[i % len(keys)])])[0] for i in range(HELD_LEASES)]
            svc_held_cpu = _service_cpu(running, reqs)
            for lease_id in held:
                running.store.release(lease_id)
            rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            conn.send({"port": running.port, "keys": [k for r in reqs for k in r], "fill_s": fill_s,
                       "in_proc": in_proc, "in_proc_cpu": in_proc_cpu, "service_cpu": svc_cpu,
                       "service_held_cpu": svc_held_cpu, "rss_gb": rss_gb, "calib": calib})
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # "stop"
            await running.stop(0)

    import uvloop

    uvloop.run(run())


def measure(n_variants: int, n_requests: int, seed: int = 0) -> dict:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(n_variants, n_requests, seed, there), daemon=True)
    proc.start()
    try:
        got = here.recv()
        flat = got["keys"]
        reqs = [flat[i : i + 5] for i in range(0, len(flat), 5)]
        grpc_lat, blocking_lat, floor_lat, stream_lat = [], [], [], []
        address = f"127.0.0.1:{got['port']}"

        async def client() -> None:
            async with AsyncKVClient(address) as ac:
                with KVClient(address) as c:
                    check = health_pb2_grpc.HealthStub(c.core.channel).Check
                    ping = health_pb2.HealthCheckRequest()
                    plan_rpc = pb_grpc.KVCacheStub(c.core.channel).Plan

                    async def unary(r: list[str]) -> str:
                        return plan_rpc(plan_request(MODEL, [(k, TOKENS) for k in r], 64)).lease_id

                    async def blocking(r: list[str]) -> str:
                        return c.plan(MODEL, [(k, TOKENS) for k in r], 64).lease_id

                    async def stream(r: list[str]) -> str:
                        return (await ac.plan(MODEL, [(k, TOKENS) for k in r], 64)).lease_id

                    async def floor(r: list[str]) -> str:
                        check(ping)
                        return ""

                    async def release_sync(lease_id: str) -> None:
                        c.release(lease_id)

                    kinds = [(unary, grpc_lat, release_sync), (blocking, blocking_lat, release_sync),
                             (floor, floor_lat, None), (stream, stream_lat, ac.release)]

                    async def run_block(call, block, out, release) -> None:  # noqa: ANN001
                        leases = []
                        for r in block:
                            s = time.perf_counter()
                            leases.append(await call(r))
                            out.append(time.perf_counter() - s)
                        for lease_id in filter(None, leases):  # as an engine does once its request is done
                            await release(lease_id)

                    for call, _, release in kinds:  # warm the channels
                        await run_block(call, reqs[:50], [], release)
                    for b, i in enumerate(range(0, len(reqs), BLOCK)):
                        for call, out, release in kinds[b % len(kinds) :] + kinds[: b % len(kinds)]:
                            await run_block(call, reqs[i : i + BLOCK], out, release)

        import uvloop

        uvloop.run(client())
        here.send("stop")
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
    us = dict(unit="_us", scale=1e6, digits=1)
    return {"variants": n_variants, "requests": n_requests, "fill_s": round(got["fill_s"], 1),
            "server_peak_rss_gb": round(got["rss_gb"], 2),
            **stats.summary(got["in_proc"], prefix="in_process_", **us),
            **stats.summary(got["in_proc_cpu"], prefix="in_process_cpu_", **us),
            **stats.summary(got["service_cpu"], prefix="service_cpu_", **us),
            **stats.summary(got["service_held_cpu"], prefix="service_cpu_held_leases_", **us),
            **stats.summary(grpc_lat, prefix="grpc_", **us), **stats.summary(blocking_lat, prefix="blocking_", **us),
            **stats.summary(stream_lat, prefix="stream_", **us), **stats.summary(floor_lat, prefix="floor_", **us),
            "load_avg": round(os.getloadavg()[0], 1), "calib_ms": round(statistics.median(got["calib"]), 1),
            "calib_spread": round(max(got["calib"]) / min(got["calib"]), 2)}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    p = argparse.ArgumentParser(prog="kvcraft bench plan-latency", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=count(), nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--requests", type=count(), default=2000)
    results.add_argument(p, "plan-latency")
    a = p.parse_args(argv)
    rows = []
    cols = [("variants", "variants", 10), ("fill s", "fill_s", 7), ("RSS GB", "server_peak_rss_gb", 7),
            ("planner p50", "in_process_p50_us", 12), ("p99", "in_process_p99_us", 8),
            ("CPU p50", "in_process_cpu_p50_us", 8), ("p99", "in_process_cpu_p99_us", 8),
            ("service CPU p50", "service_cpu_p50_us", 16), ("p99", "service_cpu_p99_us", 8),
            ("10k leases p50", "service_cpu_held_leases_p50_us", 15), ("p99", "service_cpu_held_leases_p99_us", 8),
            ("unary p50", "grpc_p50_us", 10), ("p99", "grpc_p99_us", 8),
            ("KVClient p50", "blocking_p50_us", 13), ("p99", "blocking_p99_us", 8),
            ("AsyncKVClient p50", "stream_p50_us", 18), ("p99", "stream_p99_us", 8),
            ("floor p50", "floor_p50_us", 10), ("p99", "floor_p99_us", 8), ("load", "load_avg", 5),
            ("calib ms", "calib_ms", 9), ("spread", "calib_spread", 7)]
    print("µs; planner = Planner.plan in the server process (wall, then thread CPU time); service = "
          "PlanningService.plan (CPU), also with 10k leases held; unary = the Plan RPC; KVClient = KVClient.plan, "
          "AsyncKVClient = AsyncKVClient.plan (both over PlanStream); floor = a no-op unary call (health check); "
          "calib = CPU ms of a fixed Python loop sampled in the server process during the planner's run (median; spread = slowest / fastest)")
    print(" ".join(f"{h:>{w}}" for h, _, w in cols), flush=True)
    for n in a.sizes:
        row = measure(n, a.requests)
        rows.append(row)
        print(" ".join(f"{row[k]:>{w}}" for _, k, w in cols), flush=True)
    results.save("plan-latency", argv, {"rows": rows}, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
