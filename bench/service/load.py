"""Many concurrent clients against one server on loopback: ops/s, p50/p99 per RPC, RSS.

Each level runs C clients (each its own channel, so its own connection) spread over
worker processes; every client loops over a fixed mix of RPCs on a small model until
the level's time or its op budget runs out (both bounded):

  fetch   FetchLayers of one stored variant (all layers)     40%
  store   Store of a new variant                             15%
  lookup  Lookup by chunk key                                20%
  plan    Plan over 4 stored chunks, then Release its lease  15%
  lease   Lease one variant, then Release                     5%
  stats   Admin Stats                                         5%

Several servers can be compared in one run (`--server NAME=TREE`, a checkout of this
repository each): they run one after another on identical workloads, and the table
puts their rows side by side.

    kvcraft bench load --clients 64 256 --seconds 10
    python -m kvbench.service.load --server before=/tmp/kvcraft-before --server after=.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Sequence

from kvbench import results, stats
from kvbench.common.args import count

MIX = (("fetch", 40), ("store", 15), ("lookup", 20), ("plan", 15), ("lease", 5), ("stats", 5))
# Small model shape: 4 layers, 2 KV heads, 32 tokens per chunk, head dim 64, fp16
# (32 KiB of K+V per layer, 128 KiB per variant).
LAYERS, HEADS, TOKENS, DIM = 4, 2, 32, 64
PRELOADED = 128
PACKAGES = {"kvcraft": "proto/kvcraft", "kvclient": "client", "kvkernels": "kernels", "kvbench": "bench",
            "kvservice": "kvservice", "engine_adapter": "engine_adapter"}


def _model_id() -> str:
    from kvcraft.keys import ModelSpec

    return ModelSpec("load", LAYERS, HEADS, DIM, "float16").fingerprint()


def _layers(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(HEADS, TOKENS, DIM, generator=g).half(), torch.randn(HEADS, TOKENS, DIM, generator=g).half())
            for _ in range(LAYERS)]


def _tokens(i: int) -> list[int]:
    return [i * TOKENS + t for t in range(TOKENS)]


async def _client(address: str, keys: list[str], seed: int, deadline: float, max_ops: int,
                  out: dict[str, list[float]], errors: dict[str, int]) -> None:
    from kvclient.client import AsyncKVClient
    from kvclient.errors import KVCraftError

    rng = random.Random(seed)
    names = [n for n, _ in MIX]
    weights = [w for _, w in MIX]
    model = _model_id()
    layers = _layers(seed)
    async with AsyncKVClient(address, timeout=60) as c:
        for op in range(max_ops):
            if time.monotonic() >= deadline:
                break
            name = rng.choices(names, weights)[0]
            t0 = time.perf_counter()
            try:
                if name == "fetch":
                    await c.fetch(rng.choice(keys))
                elif name == "store":
                    await c.store(model, _tokens(1_000_000 + seed * 10_000 + op), layers)
                elif name == "lookup":
                    await c.lookup(chunk_key=rng.choice(keys))
                elif name == "plan":
                    plan = await c.plan(model, [(k, TOKENS) for k in rng.sample(keys, 4)], question_tokens=16)
                    if plan.lease_id:
                        await c.release(plan.lease_id)
                elif name == "lease":
                    await c.release((await c.lease([rng.choice(keys)])).lease_id)
                else:
                    await c.stats()
            except KVCraftError as e:
                errors[f"{name} {e.code.name}"] = errors.get(f"{name} {e.code.name}", 0) + 1
                continue
            out.setdefault(name, []).append(time.perf_counter() - t0)


def _worker(address: str, keys: list[str], clients: int, first_seed: int, start_at: float, seconds: float,
            max_ops: int) -> tuple[dict[str, list[float]], dict[str, int]]:
    import uvloop

    import kvclient.client  # noqa: F401 - imports (torch) before the clock starts

    _layers(0)
    out: dict[str, list[float]] = {}
    errors: dict[str, int] = {}

    async def run() -> None:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(_client(address, keys, first_seed + i, deadline, max_ops, out, errors)
                               for i in range(clients)))

    uvloop.run(run())
    return out, errors


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def server_env(tree: Path) -> dict[str, str]:
    """PYTHONPATH that imports this tree's packages under their import names."""
    pkgs = tree / ".pkgs"
    pkgs.mkdir(exist_ok=True)
    for name, folder in PACKAGES.items():
        link = pkgs / name
        if not link.exists() and (tree / folder).exists():
            link.symlink_to(tree / folder)
    return {"PYTHONPATH": str(pkgs)}


def run_level(server_name: str, tree: Path, clients: int, seconds: float, max_ops: int, workers: int) -> dict:
    from kvclient.client import KVClient
    from kvservice.launcher import ServiceProcess

    with tempfile.TemporaryDirectory(prefix="kvcraft-load-") as tmp:
        server = ServiceProcess(Path(tmp) / "data", env=server_env(tree), host_budget_bytes=256 << 20,
                                disk_budget_bytes=4 << 30, cwd=str(tree))
        server.start()
        try:
            model = _model_id()
            with KVClient(server.address) as c:
                keys = [c.store(model, _tokens(i), _layers(i)).chunk_key for i in range(PRELOADED)]
            rss_start = _rss(server.proc.pid)
            peak = [rss_start]
            stop = threading.Event()

            def sample() -> None:
                while not stop.wait(0.1):
                    peak[0] = max(peak[0], _rss(server.proc.pid))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            per = [clients // workers + (1 if w < clients % workers else 0) for w in range(workers)]
            start_at = time.time() + 15.0  # every worker spawned and its imports done before the clock starts
            with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
                futs = [pool.submit(_worker, server.address, keys, n, 1000 * w, start_at, seconds, max_ops)
                        for w, n in enumerate(per)]
                results = [f.result() for f in futs]
            elapsed = max(seconds, 1e-9)
            stop.set()
            sampler.join()
            rss_end = _rss(server.proc.pid)
        finally:
            server.stop()
            server.close()
    lat: dict[str, list[float]] = {}
    errors: dict[str, int] = {}
    for out, errs in results:
        for k, v in out.items():
            lat.setdefault(k, []).extend(v)
        for k, v in errs.items():
            errors[k] = errors.get(k, 0) + v
    total = sum(len(v) for v in lat.values())
    return {
        "server": server_name, "clients": clients, "seconds": seconds, "ops": total,
        "ops_per_s": total / elapsed,
        "rpc": {k: {"ops_per_s": len(v) / elapsed, **stats.summary(v, unit="_ms", scale=1e3)}
                for k, v in sorted(lat.items())},
        "errors": errors,
        "rss_start_mib": rss_start / 2**20, "rss_peak_mib": peak[0] / 2**20, "rss_end_mib": rss_end / 2**20,
    }


def print_table(rows: list[dict]) -> None:
    names = [n for n, _ in MIX]
    print(f"{'server':<10} {'clients':>7} {'ops/s':>8} " + " ".join(f"{n + ' p50/p99 ms':>22}" for n in names)
          + f" {'RSS start/peak/end MiB':>24} errors")
    for r in rows:
        cells = []
        for n in names:
            s = r["rpc"].get(n)
            cells.append(f"{s['p50_ms']:>10.1f}/{s['p99_ms']:<11.1f}" if s else f"{'-':>22}")
        rss = f"{r['rss_start_mib']:.0f}/{r['rss_peak_mib']:.0f}/{r['rss_end_mib']:.0f}"
        print(f"{r['server']:<10} {r['clients']:>7} {r['ops_per_s']:>8.0f} " + " ".join(cells)
              + f" {rss:>24} {sum(r['errors'].values())}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    p = argparse.ArgumentParser(prog="kvcraft bench load", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=count(), nargs="+", default=[64, 256])
    p.add_argument("--seconds", type=float, default=10.0, help="per level")
    p.add_argument("--max-ops", type=count(), default=2000, help="per client and level")
    p.add_argument("--workers", type=count(), default=2, help="client processes")
    p.add_argument("--server", action="append", default=[], metavar="NAME=TREE",
                   help="a checkout to run the server from (repeat to compare); default: this one")
    results.add_argument(p, "load")
    a = p.parse_args(argv)
    here = Path(__file__).resolve().parents[2]
    servers = [s.split("=", 1) for s in a.server] or [["current", str(here)]]
    rows = []
    for clients in a.clients:
        for name, tree in servers:
            rows.append(run_level(name, Path(tree).resolve(), clients, a.seconds, a.max_ops, a.workers))
            print_table(rows[-1:])
    print()
    print_table(rows)
    results.save("load", argv, {"workers": a.workers, "mix": dict(MIX), "rows": rows}, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
