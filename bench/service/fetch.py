"""Store and fetch throughput of chunk KV, side by side in one run, each beside its limit.

Llama-3-8B shapes (32 layers, 8 kv heads, head dim 128, bf16): N chunks of T tokens.
Rows:
  grpc-stream   FetchLayers over loopback, tensors materialised (remote-client path)
  grpc-raw      the same number of messages of the same sizes from a plain grpcio
                (grpc.aio) server in its own process, received as bytes: Python gRPC's limit
  shm-local     Locate + map the host tier's shared memory + copy every layer into a
                preallocated buffer (what an engine does before its H2D copy)
  memcpy-limit  one torch copy (one thread) of the same bytes between two preallocated
                host buffers
  disk-stream   FetchLayers with no host tier: read from disk files (page cache after the
                first read; no GDS here), every layer's checksum verified
  store-client  KVClient.store of the N chunks (new chunks each repeat): durable on disk,
                copied into the host slab, metadata committed; the client is co-located,
                so this is the shared-memory path (StoreLocal) when the service has it
  store-grpc    the same through the gRPC Store stream (KVClient(local_store=False)):
                what a client on another host gets
  write-fsync   a plain write + fsync of the same bytes (one file per chunk, in the same
                data directory, writes of at most 1 MiB): the disk's limit for the Store path
"x of its limit": grpc-stream / grpc-raw, store-client and store-grpc / write-fsync and
shm-local / memcpy-limit, as throughput ratios of the same run. A path and its limit are
measured in turn, repeat after repeat (the order flipped every other repeat): the ratio
given is the median of the repeats' own ratios. This machine's speed drifts by 1.5x
within a minute (other jobs, its disk's and memory's state); measured in blocks, one
after the other, the two sides of a ratio saw different machines. GB/s is the best repeat.

Several servers can be compared in one run (`--server NAME=TREE`, a checkout of this
repository each, as in bench/service/load.py): every row is measured for each in turn, the
client is this checkout's.

    kvcraft bench fetch --chunks 4 --tokens 512 --repeat 3
    python -m kvbench.service.fetch --server before=/tmp/kvcraft-before --server after=.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from kvbench import results
from kvbench.common.args import count
from kvbench.common.rows import transfer_row
from kvbench.service.load import server_env
from kvclient.client import KVClient, Ref
from kvcraft.keys import ModelSpec
from kvservice.launcher import ServiceProcess
from kvservice.tiers.disk import write_all

SPEC = ModelSpec("llama3-8b", 32, 8, 128, "bfloat16", 500000.0)
_RAW = "/bench.Raw/Stream"
ROWS = ("grpc-stream", "grpc-raw", "shm-local", "memcpy-limit", "store-client", "store-grpc", "write-fsync",
        "disk-stream")
LIMITS = {"grpc-stream": "grpc-raw", "store-client": "write-fsync", "store-grpc": "write-fsync",
          "shm-local": "memcpy-limit"}


def _layers(tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (SPEC.num_kv_heads, tokens, SPEC.head_dim)
    return [(torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16())
            for _ in range(SPEC.num_layers)]


def _paired(paths: dict[str, Callable[[int], object]], repeat: int) -> dict[str, list[float]]:
    """Seconds of every repeat of each path, the paths taking turns within a repeat
    (in reverse order every other repeat, so a drifting machine favours none)."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    order = list(paths)
    for i in range(repeat):
        for name in order if i % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            paths[name](i)
            times[name].append(time.perf_counter() - t0)
    return times


def _raw_server(message_bytes: int, messages: int, max_message_bytes: int, conn) -> None:  # noqa: ANN001
    """A grpc.aio server whose one method streams `messages` ready-made byte strings."""
    import grpc

    async def run() -> None:
        payload = os.urandom(message_bytes)

        async def stream(request: bytes, context: object):
            for _ in range(messages):
                yield payload

        server = grpc.aio.server(options=[("grpc.max_send_message_length", max_message_bytes)])
        handler = grpc.unary_stream_rpc_method_handler(stream)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Raw", {"Stream": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await server.stop(0)

    asyncio.run(run())


@contextlib.contextmanager
def _raw_grpc(message_bytes: int, messages: int, max_message_bytes: int) -> Iterator[Callable[[int], int]]:
    """A fetch of every message from the raw server (started here, in its own process)."""
    import grpc

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_raw_server, args=(message_bytes, messages, max_message_bytes, there), daemon=True)
    proc.start()
    try:
        port = here.recv()
        opts = [("grpc.max_receive_message_length", max_message_bytes)]
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
            call = ch.unary_stream(_RAW)
            yield lambda _: sum(len(m) for m in call(b""))
        here.send("stop")
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()


def _write_fsync(root: Path, chunks: list[list[tuple[torch.Tensor, torch.Tensor]]], i: int) -> None:
    """Written as the disk tier writes (`write_all`: at most 1 MiB per write; larger ones are
    slower on VMs with free page reporting, kvservice/tiers/disk.py): this row is the limit."""
    for c, layers in enumerate(chunks):
        fd = os.open(root / f"plain-{i}-{c}.kv", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for k, v in layers:
                for t in (k, v):
                    write_all(fd, t.view(torch.uint8).numpy())
            os.fsync(fd)
        finally:
            os.close(fd)


def run(chunks: int, tokens: int, repeat: int, tree: Path | None = None) -> list[dict]:
    """The rows for one server (run from checkout `tree`; None: this one)."""
    # One copy stream, for our path and the limit alike: with torch's default two
    # threads, each of the 256 per-layer copies opens an OpenMP region that stalls
    # whenever the other core is busy (this machine is shared).
    torch.set_num_threads(1)
    model_id = SPEC.fingerprint()
    layer_bytes = 2 * SPEC.num_kv_heads * tokens * SPEC.head_dim * 2
    per_chunk = SPEC.num_layers * layer_bytes
    total = chunks * per_chunk
    big = 256 << 20
    times: dict[str, list[float]] = {}
    data = [_layers(tokens, i) for i in range(chunks)]
    where = {} if tree is None else {"env": server_env(tree), "cwd": str(tree)}
    with tempfile.TemporaryDirectory(prefix="kvcraft-fetch-") as tmp:
        server = ServiceProcess(Path(tmp) / "data", host_budget_bytes=2 * total + (1 << 20),
                                max_message_bytes=big, **where)
        server.start()
        try:
            with KVClient(server.address, max_message_bytes=big) as c:
                keys = [c.store(model_id, [i * 100000 + t for t in range(tokens)], data[i]).chunk_key
                        for i in range(chunks)]
                refs = [Ref(k) for k in keys]
                dst = torch.empty(total, dtype=torch.uint8)

                def grpc_stream(_: int) -> None:
                    for f in c.fetch_layers(refs):
                        pass  # tensors are materialised by the iterator

                def shm_local(_: int) -> None:
                    with c.fetch_local(refs) as got:
                        off = 0
                        for layers in got.layers:
                            for k, v in layers:
                                for t in (k, v):
                                    n = t.numel() * 2
                                    dst[off : off + n].copy_(t.view(torch.uint8).reshape(-1))
                                    off += n

                paths = set()

                def store_with(client: KVClient, base: int):  # noqa: ANN202
                    def store(i: int) -> None:
                        for n, layers in enumerate(data):  # new chunks: token ids of repeat i
                            r = client.store(model_id, [base + i * 10**7 + n * 100000 + t for t in range(tokens)],
                                             layers)
                            paths.add((client is c, r.local))
                    return store

                src = torch.empty(total, dtype=torch.uint8).random_(0, 255)
                with _raw_grpc(layer_bytes + 200, chunks * SPEC.num_layers, big) as grpc_raw:
                    times.update(_paired({"grpc-stream": grpc_stream, "grpc-raw": grpc_raw}, repeat))
                times.update(_paired({"shm-local": shm_local, "memcpy-limit": lambda _: dst.copy_(src)}, repeat))
                with KVClient(server.address, max_message_bytes=big, local_store=False) as remote:
                    times.update(_paired({"store-client": store_with(c, 10**7), "store-grpc": store_with(remote, 10**9),
                                          "write-fsync": lambda i: _write_fsync(Path(tmp), data, i)}, repeat))
                local_used = (True, True) in paths
            server.close()
            # The same data dir with a 1-byte host budget: every read comes from the disk
            # tier (page cache after the first), checksums verified, nothing promoted.
            server = ServiceProcess(Path(tmp) / "data", host_budget_bytes=1, max_message_bytes=big, **where)
            server.start()
            with KVClient(server.address, max_message_bytes=big) as c:
                refs = [Ref(k) for k in keys]
                times["disk-stream"] = _paired({"": lambda _: [None for _ in c.fetch_layers(refs)]}, repeat)[""]
        finally:
            server.close()
    out = [transfer_row(name, total, min(times[name])) for name in ROWS]
    by = {r["path"]: r for r in out}
    by["store-client"]["shared_memory"] = local_used  # False: the service has no StoreLocal
    for path, limit in LIMITS.items():
        ratios = [lim / ours for ours, lim in zip(times[path], times[limit])]  # throughput, repeat by repeat
        by[path]["vs_limit"] = round(statistics.median(ratios), 2)
        by[path]["vs_limit_range"] = [round(min(ratios), 2), round(max(ratios), 2)]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    p = argparse.ArgumentParser(prog="kvcraft bench fetch", description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=count(), default=4)
    p.add_argument("--tokens", type=count(), default=512)
    p.add_argument("--repeat", type=count(), default=3)
    p.add_argument("--server", action="append", default=[], metavar="NAME=TREE",
                   help="a checkout to run the service from (repeat to compare); default: this one")
    results.add_argument(p, "fetch")
    a = p.parse_args(argv)
    servers = [(n, Path(t).resolve()) for n, t in (s.split("=", 1) for s in a.server)] or [("current", None)]
    by_server = {name: run(a.chunks, a.tokens, a.repeat, tree) for name, tree in servers}
    first = next(iter(by_server.values()))
    print(f"{a.chunks} chunks x {a.tokens} tokens, Llama-3-8B KV (bf16): {first[0]['bytes'] / 2**20:.0f} MiB; "
          f"GB/s of the best of {a.repeat} repeats; x of its limit: median (min-max) of the repeats' own ratios")
    print(f"{'path':<14} " + " ".join(f"{name:>28}" for name in by_server))
    for i, r in enumerate(first):
        cells = []
        for rows in by_server.values():
            x = rows[i]
            lo, hi = x.get("vs_limit_range", (0, 0))
            cells.append(f"{x['GB_per_s']:>9}" + (f" {x['vs_limit']:.2f}x ({lo:.2f}-{hi:.2f})" if "vs_limit" in x
                                                  else " " * 18))
        print(f"{r['path']:<14} " + " ".join(f"{c:>28}" for c in cells))
    results.save("fetch", argv, {"chunks": a.chunks, "tokens": a.tokens, "repeat": a.repeat, "servers": by_server},
                 a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
