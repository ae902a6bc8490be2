"""The remote tier (Mooncake Store) in one run: fetch throughput, and what sharing saves,
with the master and each kvcraft node on a simulated host of its own.

Hosts: the Mooncake master on host "m", the kvcraft nodes on hosts "a", "b", "c", each a
network namespace of its own behind one switch (kvbench.common.netns), as tests/cluster/ runs
them; this process is the operator, reaching every host through the switch. The links are
veths on one kernel: bytes between hosts cross a real (virtual) network stack, not a wire.
Where namespaces cannot be made (not root, no `ip`), every host is 127.0.0.1 (loopback),
and the run says so and why (`--hosts` forces either).

Part 1, fetch GB/s of the same chunk KV (Llama-3-8B shapes, bf16), side by side. Node A
stores the chunks; node B joins the cluster after A's write-through, so every payload is
in A's segment (the run prints where they are), and with a 1-byte host tier it reads
them from the cluster on every fetch:
  grpc-remote     FetchLayers on node B, once, for variants only the cluster holds:
                  remote read from A's segment (across the link) + verify + stream to
                  the operator (across B's link)
  grpc-stream     FetchLayers on node A, host tier, streamed to the operator (across A's link)
  remote-tier     RemoteTier read from the operator's namespace (across A's link):
                  Mooncake get_into, header check, every layer's checksum
  disk-tier       DiskTier read of the same bytes from local files (in the temporary
                  directory), pread into a fresh buffer; the page cache is warm (the
                  files were just written), so it measures a cached read
  host-tier       HostTier read (shared-memory slab) copied into a preallocated buffer
                  (one memcpy)

Part 2, sharing: the default RAG trace (kvbench.common.workload) split across three real
kvcraft nodes by conversation (one-turn requests round-robin); each request is planned
on its node, and the chunks the plan computes are stored back there (tiny KV: one
layer, the planner only counts tokens). Reported: the share of retrieved chunk tokens
each node computes, without the remote tier (each node reuses only what it stored)
and with it (a node also plans with what the others stored).

    kvcraft bench remote                        # part 1, and part 2 on the first 1000 requests
    kvcraft bench remote --requests 0           # part 2 on the whole trace (~4000 requests, slow)
    kvcraft bench remote --hosts loopback       # every host on 127.0.0.1
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import zlib
from contextlib import nullcontext
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from kvbench import results
from kvbench.common import netns
from kvbench.common.args import count
from kvbench.common.rows import best_time, significant, transfer_row
from kvclient.client import KVClient, Ref
from kvcraft.keys import ModelSpec
from kvcraft.plans import Source, prefix_keys
from kvservice.cluster.master import MasterProcess
from kvservice.launcher import ServiceProcess

SPEC = ModelSpec("llama3-8b", 32, 8, 128, "bfloat16", 500000.0)
TINY = ModelSpec("bench-tiny", 1, 1, 2, "float16")
MiB = 1 << 20
MASTER = "m"
NODES = ("a", "b", "c")
NAMESPACE = "bench"  # remote_namespace: the key prefix in the cluster


class Loopback:
    """Every host on 127.0.0.1 in this process's namespace (kvbench.common.netns.Network's
    interface), where namespaces cannot be made."""

    operator = "127.0.0.1"

    def __init__(self, hosts: Sequence[str]) -> None:
        self.hosts = list(hosts)

    def address(self, host: str) -> str:
        return "127.0.0.1"

    def prefix(self, host: str) -> list[str]:
        return []

    def __enter__(self) -> "Loopback":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


Hosts = netns.Network | Loopback


def choose_hosts(wanted: str) -> tuple[str, str | None]:
    """("namespaces" | "loopback", why loopback where namespaces were wanted but cannot be made)."""
    if wanted == "loopback":
        return "loopback", None
    why = netns.unavailable()
    if why and wanted == "namespaces":
        raise SystemExit(f"kvcraft bench remote --hosts namespaces: simulated hosts unavailable: {why}")
    return ("loopback", why) if why else ("namespaces", None)


def _layers(spec: ModelSpec, tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (spec.num_kv_heads, tokens, spec.head_dim)
    dt = getattr(torch, spec.dtype)
    return [(torch.randn(shape, generator=g).to(dt), torch.randn(shape, generator=g).to(dt))
            for _ in range(spec.num_layers)]


def _remote_settings(master: MasterProcess, segment: int) -> dict:
    return {"remote_master": master.address, "remote_segment_bytes": segment, "remote_buffer_bytes": 64 * MiB,
            "remote_namespace": NAMESPACE}


def _master(hosts: Hosts, log: Path) -> MasterProcess:
    return MasterProcess(log, host=hosts.address(MASTER), prefix=hosts.prefix(MASTER))


def _start_node(started: list[ServiceProcess], hosts: Hosts, name: str, data_dir: Path,
                **settings: object) -> ServiceProcess:
    """`kvcraft serve` on host `name`, listening on its address (the cluster addresses
    derived, as docs/scale-out.md configures a node); in `started` before it starts, so
    the caller's `finally` closes it whatever happens."""
    node = ServiceProcess(data_dir, prefix=hosts.prefix(name), host=hosts.address(name), drain_s=0.2, **settings)
    started.append(node)
    return node.start()


def _stop_all(started: list[ServiceProcess]) -> None:
    for n in started:
        try:
            n.stop()
        finally:
            n.close()


def _operator_client(master: MasterProcess):  # noqa: ANN202 - a MooncakeClient
    """A Mooncake client of this process that contributes no memory (no payload lands
    here: every read below comes from a node's segment)."""
    from kvservice.cluster.mooncake import MooncakeClient, RemoteSettings

    return MooncakeClient(RemoteSettings(master.address, segment_bytes=0, buffer_bytes=64 * MiB))


# -- part 1: fetch ------------------------------------------------------------------------
def fetch_rows(hosts: Hosts, tmp: Path, chunks: int, tokens: int, repeat: int) -> tuple[list[dict], dict]:
    """The rows, and where the payloads were in the cluster ({host or endpoint: count})."""
    torch.set_num_threads(1)
    model_id = SPEC.fingerprint()
    per_chunk = 2 * SPEC.num_layers * SPEC.num_kv_heads * tokens * SPEC.head_dim * 2
    total = chunks * per_chunk
    rows: list[tuple[str, float]] = []
    with _master(hosts, tmp / "master.log") as master:
        remote = _remote_settings(master, 2 * total + 64 * MiB)
        big = {"max_message_bytes": 256 * MiB, "host_budget_bytes": 2 * total + MiB}
        started: list[ServiceProcess] = []
        tier = None
        try:
            a = _start_node(started, hosts, "a", tmp / "node-a", **big, **remote)
            with KVClient(a.address, max_message_bytes=256 * MiB) as ca:
                keys = [ca.store(model_id, [i * 100000 + t for t in range(tokens)], _layers(SPEC, tokens, i)).chunk_key
                        for i in range(chunks)]
            tier = _operator_tier(master)
            variants = _wait_listed(tier, keys)  # the write-through runs in the background
            # node A's segment is the only one so far: the payloads are there
            placement = _placement(tier, hosts, variants)
            # node B joins now, with a 1-byte host tier: nothing it reads from the cluster is
            # promoted, so every fetch there reads the cluster (from A's segment)
            b = _start_node(started, hosts, "b", tmp / "node-b", **{**big, "host_budget_bytes": 1}, **remote)
            with KVClient(a.address, max_message_bytes=256 * MiB) as ca, \
                    KVClient(b.address, max_message_bytes=256 * MiB) as cb:
                # node B: Plan adopts what the cluster lists; the first fetch reads the cluster
                t0 = time.perf_counter()
                cb.plan(model_id, [[i * 100000 + t for t in range(tokens)] for i in range(chunks)], 16)
                plan_s = time.perf_counter() - t0
                refs = [Ref(k) for k in keys]
                # once: later fetches hit its read cache
                rows.append(("grpc-remote: FetchLayers on node B, from the cluster",
                             best_time(lambda: [None for _ in cb.fetch_layers(refs)], 1)))
                rows.append(("grpc-stream: FetchLayers on node A, host tier",
                             best_time(lambda: [None for _ in ca.fetch_layers(refs)], repeat)))
                rows.append(("remote-tier read (Mooncake get_into + verify)", _tier_read(tier, variants, repeat)))
        finally:
            if tier is not None:
                tier.close()
            _stop_all(started)
    rows.append(("disk-tier read (pread -> new buffer, page cache warm)",
                 _disk_read(tmp / "disk", chunks, per_chunk, repeat)))
    rows.append(("host-tier read (shm slab -> buffer)", _host_read(total, repeat)))
    out = [transfer_row(n, total, s) for n, s in rows]
    out.append({"path": "plan on node B (discovers the cluster's variants)", "bytes": 0,
                "seconds": significant(plan_s), "GB_per_s": None})
    return out, placement


def _operator_tier(master: MasterProcess):  # noqa: ANN202 - a RemoteTier
    """A RemoteTier of this process's own (no read cache, no segment) over the cluster."""
    from kvservice.cluster.view import ClusterView
    from kvservice.tiers.remote import RemoteTier

    client = _operator_client(master)
    try:
        return RemoteTier(client, ClusterView(client, NAMESPACE, "bench-operator"), budget_bytes=1 << 40,
                          read_cache_bytes=0)
    except BaseException:
        client.close()
        raise


def _wait_listed(tier, keys: list[str], timeout: float = 120.0) -> dict:  # noqa: ANN001 - a RemoteTier
    """Wait until the cluster lists a variant of every chunk; their records by variant id,
    adopted by `tier` (a Plan's discovery does the same on a node)."""
    from kvservice.index import VariantIndex
    from kvservice.variant_codec import to_variant

    deadline = time.monotonic() + timeout
    while True:
        entries = tier.cluster_view().discover(keys)
        if len({e.info.chunk_key for e in entries}) == len(keys):
            break
        if time.monotonic() > deadline:
            raise RuntimeError("node A's write-through did not reach the cluster")
        time.sleep(0.05)
    variants = {e.info.variant_id: to_variant(VariantIndex(), e.info) for e in entries if not e.info.prefix_keys}
    if len(variants) != len(keys):
        raise RuntimeError(f"{len(variants)} of {len(keys)} variants listed in the cluster")
    tier.bind(variants.get)
    for e in entries:
        if e.info.variant_id in variants:
            tier.adopt(e.info.variant_id, e.info.size_bytes)
    return variants


def _placement(tier, hosts: Hosts, variants: dict) -> dict[str, int]:  # noqa: ANN001 - a RemoteTier
    """Where the payloads are: {host: count} (by segment address; with every host on
    loopback, by segment endpoint)."""
    from kvservice.cluster.records import payload_key, record_bytes

    by_address = {hosts.address(h): h for h in (MASTER, *NODES)} if isinstance(hosts, netns.Network) else {}
    out: dict[str, int] = {}
    for vid, v in variants.items():
        endpoint = tier.client.placement(payload_key(NAMESPACE, vid, record_bytes(v)))
        where = by_address.get(endpoint.rpartition(":")[0], endpoint or "absent")
        out[where] = out.get(where, 0) + 1
    return out


def _tier_read(tier, variants: dict, repeat: int) -> float:  # noqa: ANN001 - a RemoteTier
    """RemoteTier reads of the variants node A left in the cluster, from this process."""
    from kvservice.tiers.base import PayloadShape

    def read_all() -> None:  # the tier checks the header and every layer's checksum
        for vid, v in variants.items():
            tier.get_layers(vid, 0, v.num_layers, PayloadShape(v.num_layers, v.layout.layer_bytes))

    return best_time(read_all, repeat)


def _disk_read(root: Path, chunks: int, per_chunk: int, repeat: int) -> float:
    """DiskTier reads of `chunks` payloads of `per_chunk` bytes (the same layers as the
    cluster's), each into a fresh buffer, as the service's disk tier serves a fetch; just
    written, so from the page cache (the machine's caches are not dropped)."""
    from kvservice.tiers.base import PayloadShape
    from kvservice.tiers.disk import DiskTier

    shape = PayloadShape(SPEC.num_layers, per_chunk // SPEC.num_layers)
    tier = DiskTier(root, chunks * per_chunk + MiB)
    try:
        rng = np.random.default_rng(0)
        vids = [f"{i:02x}bench{i}" for i in range(chunks)]
        for vid in vids:
            w = tier.open_writer(vid, shape)
            for _ in range(shape.num_layers):
                w.write_layer(rng.integers(0, 255, shape.layer_bytes, dtype=np.uint8).tobytes())
            w.commit()

        def read() -> None:
            for vid in vids:
                tier.get_layers(vid, 0, shape.num_layers, shape)

        return best_time(read, repeat)
    finally:
        tier.close()


def _host_read(total: int, repeat: int) -> float:
    from kvservice.tiers.base import PayloadShape
    from kvservice.tiers.host import HostTier

    tier = HostTier(total + MiB, f"kvcraft-bench-remote-{os.getpid()}")
    try:
        shape = PayloadShape(1, total)
        w = tier.open_writer("v", shape)
        w.write_layer(np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8).tobytes())
        w.commit()
        dst = memoryview(bytearray(total))

        def read() -> None:  # one memcpy (a bytearray's dst[:] = view would copy twice, through a temporary)
            dst[:] = tier.get_layers("v", 0, 1, shape)

        return best_time(read, repeat)
    finally:
        tier.close()


# -- part 2: sharing on the RAG trace -----------------------------------------------------
def _tokens(chunk: str, n: int) -> list[int]:
    """Token ids of a trace chunk: its index, then positions (unique per chunk)."""
    return [int(chunk, 16)] + list(range(1, n))


def share_rows(hosts: Hosts, tmp: Path, requests: int, with_remote: bool) -> dict:
    from kvbench.common.workload import DEFAULT, generate

    trace = generate(DEFAULT)
    if requests:
        trace = trace[:requests]
    model_id = TINY.fingerprint()
    n_nodes = len(NODES)
    computed = [0] * n_nodes
    retrieved = [0] * n_nodes
    arm = "remote" if with_remote else "local"
    with (_master(hosts, tmp / f"master-{arm}.log") if with_remote else nullcontext()) as master:
        extra = _remote_settings(master, 256 * MiB) if with_remote else {}
        started: list[ServiceProcess] = []
        try:
            for n in NODES:
                _start_node(started, hosts, n, tmp / f"{arm}-{n}", lease_timeout_s=5.0, **extra)
            clients = [KVClient(n.address) for n in started]
            try:
                single = 0
                for r in trace:
                    if r.conv_id:
                        node = hash_node(r.conv_id, n_nodes)
                    else:
                        node, single = single % n_nodes, single + 1
                    c = clients[node]
                    toks = {k: _tokens(k, n) for k, n in r.chunks}
                    plan = c.plan(model_id, [toks[k] for k, _ in r.chunks], r.question_tokens,
                                  conversation_id=r.conv_id, first_turn=r.turn == 0)
                    computed[node] += plan.computed_tokens
                    retrieved[node] += sum(n for _, n in r.chunks)
                    by_key = toks_by_key(toks, model_id)
                    for cp in plan.chunks:
                        if cp.source == Source.PREFIX or (cp.source == Source.VARIANT and cp.cfo == 0.0):
                            continue
                        c.store(model_id, by_key[cp.chunk_key], _layers(TINY, cp.token_count, 0),
                                prefix_keys=prefix_keys(plan, cp))
                    if plan.lease_id:
                        c.release(plan.lease_id)
            finally:
                for c in clients:
                    c.close()
        finally:
            _stop_all(started)
    return {"arm": arm, "requests": len(trace),
            "node_share": {n: round(computed[i] / retrieved[i], 4) for i, n in enumerate(NODES)},
            "total_share": round(sum(computed) / sum(retrieved), 4)}


def toks_by_key(toks: dict[str, list[int]], model_id: str) -> dict[str, list[int]]:
    """Real chunk key -> token ids of this request's chunks."""
    from kvcraft.keys import chunk_key

    return {chunk_key(model_id, t): t for t in toks.values()}


def hash_node(conv_id: str, nodes: int = len(NODES)) -> int:
    return zlib.crc32(conv_id.encode()) % nodes


# -- the run ------------------------------------------------------------------------------
def run(hosts_kind: str, tmp: Path, chunks: int, tokens: int, repeat: int, requests: int) -> dict:
    hosts: Hosts = netns.Network((MASTER, *NODES)) if hosts_kind == "namespaces" else Loopback((MASTER, *NODES))
    with hosts:
        fetch, placement = fetch_rows(hosts, tmp, chunks, tokens, repeat)
        sharing = [share_rows(hosts, tmp, requests, False), share_rows(hosts, tmp, requests, True)]
    return {"hosts": hosts_kind, "chunks": chunks, "tokens": tokens, "model": "Llama-3-8B shapes, bf16",
            "payload_placement": placement, "fetch": fetch, "sharing": sharing}


def describe_hosts(kind: str, why: str | None) -> str:
    if kind == "namespaces":
        return ("hosts: network namespaces (master on host m, nodes a b c, each its own namespace; "
                "links: veths into one bridge, on one kernel)")
    return "hosts: loopback (master and every node on 127.0.0.1" + (
        f"; simulated hosts unavailable: {why})" if why else ", as asked)")


def print_result(out: dict) -> None:
    fetch = out["fetch"]
    where = ", ".join(f"{k}: {v}" for k, v in sorted(out["payload_placement"].items()))
    print(f"part 1: {out['chunks']} chunks x {out['tokens']} tokens, Llama-3-8B KV (bf16): "
          f"{fetch[0]['bytes'] / MiB:.0f} MiB; node A stores them, node B fetches from the cluster "
          f"(payload segments: {where})")
    print(f"{'path':<52} {'seconds':>8} {'GB/s':>6}")
    for r in fetch:
        print(f"{r['path']:<52} {r['seconds']:>8} {r['GB_per_s'] if r['GB_per_s'] is not None else '':>6}")
    shares = out["sharing"]
    print(f"\npart 2: default RAG trace, first {shares[0]['requests']} requests, split across "
          f"{len(NODES)} nodes by conversation; share of retrieved chunk tokens each node computes:")
    print(f"{'remote tier':<12}" + "".join(f" {'node ' + n.upper():>8}" for n in NODES) + f" {'all':>8}")
    for s in shares:
        print(f"{'on' if s['arm'] == 'remote' else 'off':<12}"
              + "".join(f" {s['node_share'][n]:>8.1%}" for n in NODES) + f" {s['total_share']:>8.1%}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    p = argparse.ArgumentParser(prog="kvcraft bench remote", description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=count(), default=4)
    p.add_argument("--tokens", type=count(), default=256)
    p.add_argument("--repeat", type=count(), default=3)
    p.add_argument("--requests", type=count(0), default=1000, help="first N requests of the default trace; 0 = all")
    p.add_argument("--hosts", choices=("auto", "namespaces", "loopback"), default="auto",
                   help="auto: network namespaces where they can be made (root, iproute2), else loopback")
    results.add_argument(p, "remote")
    a = p.parse_args(argv)
    kind, why = choose_hosts(a.hosts)
    print(describe_hosts(kind, why), flush=True)
    with tempfile.TemporaryDirectory(prefix="kvcraft-remote-") as tmp:
        out = run(kind, Path(tmp), a.chunks, a.tokens, a.repeat, a.requests)
    if why:
        out["loopback_because"] = why
    print_result(out)
    results.save("remote", argv, out, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
