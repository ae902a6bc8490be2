"""Plan latency, in process and over gRPC on loopback, with N variants stored.

Variants are metadata only (issue 6 allows it): records are put straight into the
store's index and the planner's catalog of a server running in this process, so a
million of them need no payload files. Everything a Plan touches is real: the
planner, the lease on the reused variants, the gRPC round trip.

    kvcraft bench plan-latency --sizes 10000 100000 1000000 --requests 2000
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

from kvclient.client import KVClient
from kvcraft.keys import ModelSpec, chunk_key, variant_id
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.config import load_config
from kvcraft.layout import layer_layout
from kvservice.planner import ChunkRef
from kvservice.planning import planner_info
from kvservice.server import RunningServer, start_server
from kvservice.store import _Variant

MODEL = ModelSpec("llama3-8b", 32, 8, 128, "bfloat16", 500000.0).fingerprint()
TOKENS = 512
SPEC = pb.TensorSpec(dtype=pb.BFLOAT16, shape=[8, TOKENS, 128])


def _fill(running: RunningServer, n_variants: int, seed: int) -> list[str]:
    """n_variants metadata records: chunks with 1..4 variants behind random prefixes."""
    rng = random.Random(seed)
    store = running.store
    planning = store.listeners[0]
    layout = layer_layout(SPEC, SPEC, TOKENS)
    keys: list[str] = []
    made = 0
    while made < n_variants:
        key = chunk_key(MODEL, [len(keys), 7, 7])
        keys.append(key)
        for m in range(min(rng.randint(1, 4), n_variants - made)):
            prefix = [] if m == 0 else [chunk_key(MODEL, [rng.randrange(len(keys)), 7, 7])]
            stats = pb.VariantStats(a=rng.random() * 0.3 if prefix else 0.0, b=0.3 + rng.random() * 0.5,
                                    prefix_attention=[0.2] * len(prefix))
            info = pb.VariantInfo(variant_id=variant_id(key, prefix), chunk_key=key, model_id=MODEL,
                                  prefix_keys=prefix, token_count=TOKENS, num_layers=32, key_spec=SPEC,
                                  value_spec=SPEC, stats=stats, tier="disk", size_bytes=32 * layout.layer_bytes)
            store._variants[info.variant_id] = _Variant(info, layout)
            store._chunks.setdefault(key, []).append(info.variant_id)
            planning.catalog.put(planner_info(info))
            made += 1
    return keys


def _requests(keys: list[str], n: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    hot = keys[: max(50, len(keys) // 100)]  # Zipf-ish: most retrievals hit a hot set
    return [[rng.choice(hot) if rng.random() < 0.6 else rng.choice(keys) for _ in range(5)] for _ in range(n)]


def _pcts(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return statistics.median(s) * 1e6, s[int(0.99 * (len(s) - 1))] * 1e6


def measure(n_variants: int, n_requests: int, seed: int = 0) -> dict:
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict = {}

    async def run() -> None:
        with tempfile.TemporaryDirectory(prefix="kvcraft-planlat-") as tmp:
            # host budget of 1 byte: Plan's preload skips the metadata-only variants (no payload to read)
            cfg = load_config(env={}, overrides={"port": 0, "data_dir": tmp, "max_variants": 10 * n_variants,
                                                 "host_budget_bytes": 1})
            holder["server"] = await start_server(cfg)
            holder["stop"] = asyncio.Event()
            ready.set()
            await holder["stop"].wait()
            await holder["server"].stop(0)

    t = threading.Thread(target=lambda: loop.run_until_complete(run()), daemon=True)
    t.start()
    ready.wait()
    running: RunningServer = holder["server"]
    t0 = time.perf_counter()
    keys = _fill(running, n_variants, seed)
    fill_s = time.perf_counter() - t0
    reqs = _requests(keys, n_requests, seed + 1)
    planning = running.store.listeners[0]
    gc.collect()
    gc.freeze()  # the filled index is long-lived: keep the collector off it, as a server would

    in_proc = []
    for r in reqs:
        s = time.perf_counter()
        planning.planner.plan(MODEL, "", [ChunkRef(k, TOKENS) for k in r], 64)
        in_proc.append(time.perf_counter() - s)

    grpc_lat = []
    with KVClient(f"127.0.0.1:{running.port}") as c:
        for r in reqs[:50]:  # warm the channel
            c.release(c.plan(MODEL, [(k, TOKENS) for k in r], 64).lease_id or "-")
        for r in reqs:
            s = time.perf_counter()
            resp = c.plan(MODEL, [(k, TOKENS) for k in r], 64)
            grpc_lat.append(time.perf_counter() - s)
            if resp.lease_id:
                c.release(resp.lease_id)
    loop.call_soon_threadsafe(holder["stop"].set)
    t.join()
    gc.unfreeze()
    p50, p99 = _pcts(in_proc)
    g50, g99 = _pcts(grpc_lat)
    return {"variants": n_variants, "requests": n_requests, "fill_s": round(fill_s, 1),
            "in_process_p50_us": round(p50, 1), "in_process_p99_us": round(p99, 1),
            "grpc_p50_us": round(g50, 1), "grpc_p99_us": round(g99, 1)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvcraft bench plan-latency")
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--json", default="bench-plan-latency.json")
    a = p.parse_args(argv)
    rows = []
    print(f"{'variants':>10} {'in-proc p50 us':>15} {'p99 us':>8} {'gRPC p50 us':>12} {'p99 us':>8}")
    for n in a.sizes:
        row = measure(n, a.requests)
        rows.append(row)
        print(f"{n:>10} {row['in_process_p50_us']:>15} {row['in_process_p99_us']:>8} "
              f"{row['grpc_p50_us']:>12} {row['grpc_p99_us']:>8}", flush=True)
    Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0
