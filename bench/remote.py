"""The remote tier (Mooncake Store) in one run: fetch throughput, and what sharing saves.

Part 1, fetch GB/s of the same chunk KV (Llama-3-8B shapes, bf16), side by side:
  remote-tier     RemoteTier read on node B of variants node A wrote: Mooncake
                  get_into over TCP loopback, header check, every layer's checksum
  host-tier       HostTier read (shared-memory slab) copied into a preallocated buffer
  grpc-stream     FetchLayers from a kvcraft server over loopback, host tier
  grpc-remote     FetchLayers from node B, once, for variants only the cluster holds (node A
                  stored them): remote read + verify + stream, promoted to B's host after

Part 2, sharing: the default RAG trace (kvbench.workload) split across two real
kvcraft nodes by conversation (one-turn requests alternate); each request is planned
on its node, and the chunks the plan computes are stored back there (tiny KV: one
layer, the planner only counts tokens). Reported: the share of retrieved chunk tokens
each node computes, without the remote tier (each node reuses only what it stored)
and with it (a node also plans with what the other stored).

    kvcraft bench remote                                   # part 1, and part 2 on the first 1000 requests
    kvcraft bench remote --requests 0                      # part 2 on the whole trace (~4000 requests, slow)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from kvbench.rows import best_time, significant, transfer_row
from kvclient.client import KVClient, Ref
from kvcraft.keys import ModelSpec
from kvcraft.plans import Source, prefix_keys
from kvservice.cluster.mooncake import MasterProcess
from kvservice.launcher import ServiceProcess

SPEC = ModelSpec("llama3-8b", 32, 8, 128, "bfloat16", 500000.0)
TINY = ModelSpec("bench-tiny", 1, 1, 2, "float16")
MiB = 1 << 20


def _layers(spec: ModelSpec, tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (spec.num_kv_heads, tokens, spec.head_dim)
    dt = getattr(torch, spec.dtype)
    return [(torch.randn(shape, generator=g).to(dt), torch.randn(shape, generator=g).to(dt))
            for _ in range(spec.num_layers)]


def _remote_settings(master: MasterProcess, segment: int) -> dict:
    return {"remote_master": master.address, "remote_segment_bytes": segment, "remote_buffer_bytes": 64 * MiB,
            "remote_namespace": "bench"}


def fetch_rows(tmp: Path, chunks: int, tokens: int, repeat: int) -> list[dict]:
    torch.set_num_threads(1)
    model_id = SPEC.fingerprint()
    per_chunk = 2 * SPEC.num_layers * SPEC.num_kv_heads * tokens * SPEC.head_dim * 2
    total = chunks * per_chunk
    segment = 2 * total + 64 * MiB
    rows: list[tuple[str, float]] = []
    with MasterProcess(tmp / "master.log") as master:
        remote = _remote_settings(master, segment)
        big = {"max_message_bytes": 256 * MiB, "host_budget_bytes": 2 * total + MiB}
        a = ServiceProcess(tmp / "node-a", **big, **remote).start()
        # node B with a 1-byte host tier: nothing it reads from the cluster is promoted,
        # so every fetch there reads the cluster
        b = ServiceProcess(tmp / "node-b", **{**big, "host_budget_bytes": 1}, **remote).start()
        try:
            with KVClient(a.address, max_message_bytes=256 * MiB) as ca, \
                    KVClient(b.address, max_message_bytes=256 * MiB) as cb:
                keys = [ca.store(model_id, [i * 100000 + t for t in range(tokens)], _layers(SPEC, tokens, i)).chunk_key
                        for i in range(chunks)]
                _wait_listed(master, keys)  # the write-through runs in the background
                # node B: Plan adopts what the cluster lists; the first fetch reads the cluster
                t0 = time.perf_counter()
                cb.plan(model_id, [[i * 100000 + t for t in range(tokens)] for i in range(chunks)], 16)
                plan_s = time.perf_counter() - t0
                refs = [Ref(k) for k in keys]
                rows.append(("grpc-remote: FetchLayers on node B, from the cluster",
                             best_time(lambda: [None for _ in cb.fetch_layers(refs)], 1)))  # once: later ones hit its read cache
                rows.append(("grpc-stream: FetchLayers on node A, host tier",
                             best_time(lambda: [None for _ in ca.fetch_layers(refs)], repeat)))
            rows.append(("remote-tier read (Mooncake get_into + verify)", _tier_read(master, tmp, keys, total, repeat)))
        finally:
            for n in (a, b):
                n.stop()
                n.close()
    rows.append(("host-tier read (shm slab -> buffer)", _host_read(total, repeat)))
    out = [transfer_row(n, total, s) for n, s in rows]
    out.append({"path": "plan on node B (discovers the cluster's variants)", "bytes": 0,
                "seconds": significant(plan_s), "GB_per_s": None})
    return out


def _wait_listed(master: MasterProcess, keys: list[str], timeout: float = 120.0) -> None:
    from kvservice.cluster.mooncake import MooncakeClient, RemoteSettings
    from kvservice.cluster.view import ClusterView

    client = MooncakeClient(RemoteSettings(master.address, segment_bytes=16 * MiB, buffer_bytes=16 * MiB))
    try:
        view = ClusterView(client, "bench", "bench-waiter")
        deadline = time.monotonic() + timeout
        while len({e.info.chunk_key for e in view.discover(keys)}) < len(keys):
            if time.monotonic() > deadline:
                raise RuntimeError("node A's write-through did not reach the cluster")
            time.sleep(0.05)
    finally:
        client.close()


def _tier_read(master: MasterProcess, tmp: Path, keys: list[str], total: int, repeat: int) -> float:
    """RemoteTier reads of the variants the nodes left in the cluster, from a fresh client."""
    from kvservice.cluster.mooncake import MooncakeClient, RemoteSettings
    from kvservice.cluster.view import ClusterView
    from kvservice.tiers.remote import RemoteTier
    from kvservice.tiers.base import PayloadShape
    from kvservice.index import VariantIndex
    from kvservice.variant_codec import to_variant

    client = MooncakeClient(RemoteSettings(master.address, segment_bytes=64 * MiB, buffer_bytes=64 * MiB))
    try:
        view = ClusterView(client, "bench", "bench-reader")
        tier = RemoteTier(client, view, budget_bytes=1 << 40, read_cache_bytes=0)
        entries = view.discover(keys)
        variants = {e.info.variant_id: to_variant(VariantIndex(), e.info) for e in entries if not e.info.prefix_keys}
        tier.bind(variants.get)
        for e in entries:
            tier.adopt(e.info.variant_id, e.info.size_bytes)
        if len(variants) != len(keys):
            raise RuntimeError(f"{len(variants)} of {len(keys)} variants listed in the cluster")

        def read_all() -> None:  # the tier checks the header and every layer's checksum
            for vid, v in variants.items():
                tier.get_layers(vid, 0, v.num_layers, PayloadShape(v.num_layers, v.layout.layer_bytes))

        return best_time(read_all, repeat)
    finally:
        client.close()


def _host_read(total: int, repeat: int) -> float:
    from kvservice.tiers.host import HostTier
    from kvservice.tiers.base import PayloadShape

    tier = HostTier(total + MiB, f"kvcraft-bench-remote-{id(total)}")
    try:
        shape = PayloadShape(1, total)
        w = tier.open_writer("v", shape)
        w.write_layer(np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8).tobytes())
        w.commit()
        dst = bytearray(total)

        def read() -> None:
            dst[:] = tier.get_layers("v", 0, 1, shape)

        return best_time(read, repeat)
    finally:
        tier.close()


# -- part 2: sharing on the RAG trace -------------------------------------------------
def _tokens(chunk: str, n: int) -> list[int]:
    """Token ids of a trace chunk: its index, then positions (unique per chunk)."""
    return [int(chunk, 16)] + list(range(1, n))


def share_rows(tmp: Path, requests: int, with_remote: bool) -> dict:
    from kvbench.workload import DEFAULT, generate

    trace = generate(DEFAULT)
    if requests:
        trace = trace[:requests]
    model_id = TINY.fingerprint()
    computed = [0, 0]
    retrieved = [0, 0]
    arm = "remote" if with_remote else "local"
    with (MasterProcess(tmp / f"master-{arm}.log") if with_remote else nullcontext()) as master:
        extra = _remote_settings(master, 256 * MiB) if with_remote else {}
        nodes = [ServiceProcess(tmp / f"{arm}-{n}", lease_timeout_s=5.0, **extra).start() for n in "ab"]
        try:
            clients = [KVClient(n.address) for n in nodes]
            single = 0
            for r in trace:
                if r.conv_id:
                    node = hash_node(r.conv_id)
                else:
                    node, single = single % 2, single + 1
                c = clients[node]
                toks = {k: _tokens(k, n) for k, n in r.chunks}
                plan = c.plan(model_id, [toks[k] for k, _ in r.chunks], r.question_tokens,
                              conversation_id=r.conv_id, first_turn=r.turn == 0)
                computed[node] += plan.computed_tokens
                retrieved[node] += sum(n for _, n in r.chunks)
                for cp in plan.chunks:
                    if cp.source == Source.PREFIX or (cp.source == Source.VARIANT and cp.cfo == 0.0):
                        continue
                    layers = _layers(TINY, cp.token_count, 0)
                    c.store(model_id, toks_by_key(toks, model_id)[cp.chunk_key], layers,
                            prefix_keys=prefix_keys(plan, cp))
                if plan.lease_id:
                    c.release(plan.lease_id)
            for c in clients:
                c.close()
        finally:
            for n in nodes:
                n.stop()
                n.close()
    return {"arm": arm, "requests": len(trace), "node_a_share": round(computed[0] / retrieved[0], 4),
            "node_b_share": round(computed[1] / retrieved[1], 4),
            "total_share": round(sum(computed) / sum(retrieved), 4)}


def toks_by_key(toks: dict[str, list[int]], model_id: str) -> dict[str, list[int]]:
    """Real chunk key -> token ids of this request's chunks."""
    from kvcraft.keys import chunk_key

    return {chunk_key(model_id, t): t for t in toks.values()}


def hash_node(conv_id: str) -> int:
    import zlib

    return zlib.crc32(conv_id.encode()) % 2


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvcraft bench remote")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--requests", type=int, default=1000, help="first N requests of the default trace; 0 = all")
    p.add_argument("--json", default="bench-remote.json")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvcraft-remote-") as tmp:
        fetch = fetch_rows(Path(tmp), a.chunks, a.tokens, a.repeat)
        print(f"{a.chunks} chunks x {a.tokens} tokens, Llama-3-8B KV (bf16): {fetch[0]['bytes'] / MiB:.0f} MiB")
        print(f"{'path':<52} {'seconds':>8} {'GB/s':>6}")
        for r in fetch:
            print(f"{r['path']:<52} {r['seconds']:>8} {r['GB_per_s'] if r['GB_per_s'] is not None else '':>6}")
        shares = [share_rows(Path(tmp), a.requests, False), share_rows(Path(tmp), a.requests, True)]
    print(f"\ndefault RAG trace, first {shares[0]['requests']} requests, split across two nodes:")
    print(f"{'remote tier':<14} {'node A computes':>16} {'node B computes':>16} {'both':>8}")
    for s in shares:
        print(f"{'on' if s['arm'] == 'remote' else 'off':<14} {s['node_a_share']:>16.1%} {s['node_b_share']:>16.1%} "
              f"{s['total_share']:>8.1%}")
    Path(a.json).write_text(json.dumps({"fetch": fetch, "sharing": shares}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
