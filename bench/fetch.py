"""Fetch throughput of stored chunk KV into engine memory, side by side in one run.

Llama-3-8B shapes (32 layers, 8 kv heads, head dim 128, bf16): N chunks of T tokens.
Rows:
  grpc-stream   FetchLayers over loopback, tensors materialised (remote-client path)
  shm-local     Locate + map the host tier's shared memory + copy every layer into a
                preallocated buffer (what an engine does before its H2D copy)
  disk-stream   FetchLayers with no host tier: read from disk files (page cache after the
                first read; no GDS here), every layer's checksum verified
  memcpy-limit  one torch copy (one thread) of the same bytes between two preallocated
                host buffers

    kvcraft bench fetch --chunks 4 --tokens 512 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch

from kvclient.client import KVClient, Ref
from kvcraft.keys import ModelSpec
from kvservice.launcher import ServiceProcess

SPEC = ModelSpec("llama3-8b", 32, 8, 128, "bfloat16", 500000.0)


def _layers(tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (SPEC.num_kv_heads, tokens, SPEC.head_dim)
    return [(torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16())
            for _ in range(SPEC.num_layers)]


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def run(chunks: int, tokens: int, repeat: int) -> list[dict]:
    # One copy stream, for our path and the limit alike: with torch's default two
    # threads, each of the 256 per-layer copies opens an OpenMP region that stalls
    # whenever the other core is busy (this machine is shared).
    torch.set_num_threads(1)
    model_id = SPEC.fingerprint()
    per_chunk = 2 * SPEC.num_layers * SPEC.num_kv_heads * tokens * SPEC.head_dim * 2
    total = chunks * per_chunk
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvcraft-fetch-") as tmp:
        server = ServiceProcess(Path(tmp) / "data", host_budget_bytes=2 * total + (1 << 20),
                                max_message_bytes=256 << 20)
        server.start()
        try:
            with KVClient(server.address, max_message_bytes=256 << 20) as c:
                keys = [c.store(model_id, [i * 100000 + t for t in range(tokens)], _layers(tokens, i)).chunk_key
                        for i in range(chunks)]
                refs = [Ref(k) for k in keys]
                dst = torch.empty(total, dtype=torch.uint8)

                def grpc_stream() -> None:
                    for f in c.fetch_layers(refs):
                        pass  # tensors are materialised by the iterator

                def shm_local() -> None:
                    with c.fetch_local(refs) as got:
                        off = 0
                        for layers in got.layers:
                            for k, v in layers:
                                for t in (k, v):
                                    n = t.numel() * 2
                                    dst[off : off + n].copy_(t.view(torch.uint8).reshape(-1))
                                    off += n

                src = torch.empty(total, dtype=torch.uint8).random_(0, 255)
                rows.append(("grpc-stream", _best(grpc_stream, repeat)))
                rows.append(("shm-local", _best(shm_local, repeat)))
                rows.append(("memcpy-limit", _best(lambda: dst.copy_(src), repeat)))
            server.close()
            # The same data dir with a 1-byte host budget: every read comes from the disk
            # tier (page cache after the first), checksums verified, nothing promoted.
            server = ServiceProcess(Path(tmp) / "data", host_budget_bytes=1, max_message_bytes=256 << 20)
            server.start()
            with KVClient(server.address, max_message_bytes=256 << 20) as c:
                refs = [Ref(k) for k in keys]
                rows.append(("disk-stream", _best(lambda: [None for _ in c.fetch_layers(refs)], repeat)))
        finally:
            server.close()
    return [{"path": name, "bytes": total, "seconds": round(s, 4), "GB_per_s": round(total / s / 1e9, 2)}
            for name, s in rows]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvcraft bench fetch")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default="bench-fetch.json")
    a = p.parse_args(argv)
    rows = run(a.chunks, a.tokens, a.repeat)
    print(f"{a.chunks} chunks x {a.tokens} tokens, Llama-3-8B KV (bf16): {rows[0]['bytes'] / 2**20:.0f} MiB")
    print(f"{'path':<40} {'seconds':>8} {'GB/s':>6}")
    for r in rows:
        print(f"{r['path']:<40} {r['seconds']:>8} {r['GB_per_s']:>6}")
    Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0
