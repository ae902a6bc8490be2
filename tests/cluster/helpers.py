"""What the cluster tests ask of the cluster (tests/cluster/conftest.py builds it): engines
computing prompts, what a node holds, what the global view lists, health checks while a
fault lasts."""

from __future__ import annotations

import threading
import time
from typing import Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvclient.client import KVClient
from kvservice.index import VariantIndex
from kvservice.tiers.base import PayloadShape
from kvservice.tiers.remote import RemoteTier
from kvservice.variant_codec import to_variant
from tests.cluster.conftest import wait_for


def assert_right(r: dict) -> None:
    """The answer is full prefill's."""
    assert r["answer"] == r["full_answer"], r


def compute(cluster, host: str, prompts: Iterable[int]) -> list[dict]:
    """Engine on `host` computes `prompts` through its own node; stored back and listed."""
    addr = cluster.address(host)
    out = [cluster.engines[host].prefill(addr, p) for p in prompts]
    cluster.engines[host].flush(addr)
    for r in out:
        assert_right(r)
    return out


def reaches(cluster, host: str):
    """What node `host` reaches of the cluster now (Admin Stats `cluster`: master_up,
    silent_segments)."""
    with KVClient(cluster.address(host)) as c:
        stats = c.stats()
    assert stats.HasField("cluster"), f"node {host.upper()} says it is no cluster node"
    return stats.cluster


def wait_master(cluster, hosts: Iterable[str], up: bool, timeout: float) -> None:
    """Wait until every node of `hosts` says its master answers (`up`) or does not: a node
    that has not noticed the master is back plans from its own tiers, whatever the cluster
    lists."""
    hosts = list(hosts)
    wait_for(f"{', '.join(hosts).upper()} say the master is {'up' if up else 'down'}",
             lambda: all(reaches(cluster, h).master_up == up for h in hosts), timeout)


def wait_reading_every_segment(cluster, hosts: Iterable[str], timeout: float) -> None:
    """Wait until no node of `hosts` skips a segment (a node resumed answers the others'
    probes within a few tenths of a second)."""
    hosts = list(hosts)
    wait_for(f"{', '.join(hosts).upper()} read every segment",
             lambda: not any(reaches(cluster, h).silent_segments for h in hosts), timeout)


def chunk_vids(cluster, host: str, local: bool = False) -> dict[str, list[str]]:
    """chunk key -> the variant ids node `host` holds (`local`: in its own tiers, not only
    known from the cluster)."""
    with KVClient(cluster.address(host)) as c:
        return {ch.chunk_key: [v.variant_id for v in c.get_chunk(ch.chunk_key) if not local or v.tier != "remote"]
                for ch in c.list_chunks(page_size=1000).chunks}


def listed(cluster, chunk_keys: Iterable[str]) -> set[str]:
    return {e.info.variant_id for e in cluster.view.discover(list(chunk_keys))}


def unlisted(cluster, held: dict[str, list[str]]) -> set[str]:
    """The variants of `held` (chunk key -> variant ids) the cluster's view does not list."""
    return {v for vs in held.values() for v in vs} - listed(cluster, held)


def all_listed(cluster, held: dict[str, list[str]]) -> bool:
    return not unlisted(cluster, held)


def chunks_listed(cluster, chunk_keys) -> bool:
    """Every chunk has some variant in the cluster's view."""
    return {e.info.chunk_key for e in cluster.view.discover(list(chunk_keys))} == set(chunk_keys)


def misdescribed(cluster, chunk_keys: Iterable[str]) -> list[str]:
    """Listed entries whose payload is not the bytes the entry describes: read as a node
    reads a listed variant (the payload the entry names; its header must carry the entry's
    record, every layer its checksum). Entries whose payload left meanwhile do not count."""
    records: dict = {}
    tier = RemoteTier(cluster.view.client, cluster.view, budget_bytes=0, read_cache_bytes=0)
    tier.bind(records.get)
    bad = []
    for e in cluster.view.discover(list(chunk_keys)):
        v = to_variant(VariantIndex(), e.info)
        records[v.variant_id] = v
        tier.adopt(v.variant_id, v.size_bytes)
        try:
            tier.get_layers(v.variant_id, 0, v.num_layers, PayloadShape(v.num_layers, v.layout.layer_bytes))
        except KeyError as err:
            if "gone" not in str(err) and "unavailable" not in str(err):
                bad.append(f"{e.info.chunk_key}/{v.variant_id} (listed by {e.holder}): {err}")
    return bad


class HealthWatch:
    """Health checks of nodes, one every `every` seconds per node, in a thread while the
    block runs: `took` holds how long each took (a check that fails counts as 60 s)."""

    def __init__(self, addresses: Iterable[str], every: float = 0.05) -> None:
        self.addresses = list(addresses)
        self.every = every
        self.took: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        channels = [grpc.insecure_channel(a) for a in self.addresses]
        stubs = [health_pb2_grpc.HealthStub(ch) for ch in channels]
        try:
            while not self._stop.wait(self.every):
                for stub in stubs:
                    t0 = time.monotonic()
                    try:
                        ok = stub.Check(health_pb2.HealthCheckRequest(), timeout=60).status
                        took = time.monotonic() - t0 if ok == health_pb2.HealthCheckResponse.SERVING else 60.0
                    except grpc.RpcError:
                        took = 60.0
                    self.took.append(took)
        finally:
            for ch in channels:
                ch.close()

    @property
    def slowest(self) -> float:
        return max(self.took, default=0.0)

    def quantile(self, q: float) -> float:
        ordered = sorted(self.took)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
