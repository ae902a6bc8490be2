"""Two real kvcraft servers sharing a real Mooncake Store cluster on loopback.

Node A and node B are `kvcraft serve` processes whose last tier is the remote tier
on one `mooncake_master` (127.0.0.1, free ports). Bytes are compared with the
tensors the test stored; the cluster is observed through a Mooncake client of the
test's own. Polls have deadlines (the write-through is asynchronous by design);
nothing sleeps for timing.
"""

from __future__ import annotations

import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvclient.client import KVClient, Ref
from kvclient.errors import NotFoundError
from kvcraft.keys import ModelSpec, chunk_key, variant_id
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.cluster.master import free_port
from kvservice.cluster.view import ClusterView
from kvservice.launcher import ServiceProcess

from tests.conftest import random_layers, wait_for
from tests.service.remote_helpers import MiB

SPEC = ModelSpec("remote-test", num_layers=4, num_kv_heads=2, head_dim=16, dtype="bfloat16")
MODEL = SPEC.fingerprint()
NS = "kvtest"


def assert_bit_identical(got, want) -> None:
    assert len(got) == len(want)
    for (gk, gv), (wk, wv) in zip(got, want):
        assert torch.equal(gk.view(torch.int16), wk.view(torch.int16))
        assert torch.equal(gv.view(torch.int16), wv.view(torch.int16))


def tokens_of(i: int, n: int = 24) -> list[int]:
    return [1_000_000 + i] + list(range(1, n))


def remote_settings(master, **extra) -> dict:
    return {"remote_master": master.address, "remote_namespace": NS, "remote_segment_bytes": 128 * MiB,
            "remote_buffer_bytes": 16 * MiB, "drain_s": 0.2, **extra}


def wait_listed(view: ClusterView, key: str, vid: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while vid not in {e.info.variant_id for e in view.discover([key])}:
        if time.monotonic() > deadline:
            raise AssertionError(f"variant {vid} was not listed in the cluster within {timeout:.0f}s")
        time.sleep(0.05)


def master_up_gauge(node: ServiceProcess) -> float:
    """kvcraft_cluster_master_up as the node's metrics endpoint gives it."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{node.settings['metrics_port']}/metrics", timeout=10).read()
    (sample,) = [m.samples[0] for m in text_string_to_metric_families(text.decode())
                 if m.name == "kvcraft_cluster_master_up"]
    return sample.value


@pytest.fixture(scope="module")
def nodes(cluster, tmp_path_factory):
    """Node A and node B (B with a 1-byte host tier: what it reads from the cluster
    stays remote-only, so every fetch of it really reads the cluster)."""
    tmp = tmp_path_factory.mktemp("nodes")
    a = ServiceProcess(tmp / "node-a", metrics_port=free_port(), **remote_settings(cluster.master)).start()
    b = ServiceProcess(tmp / "node-b", host_budget_bytes=1, **remote_settings(cluster.master)).start()
    yield a, b
    for n in (a, b):  # SIGTERM: each leaves the cluster (unmounts its segment) on the way out
        n.stop()
        n.close()


@pytest.fixture(scope="module")
def view(cluster):
    return ClusterView(cluster.client(), NS, holder="test")


def test_chunk_stored_through_a_is_planned_and_fetched_through_b(nodes, view):
    a, b = nodes
    layers = random_layers(1, (2, 24, 16), SPEC.num_layers, torch.bfloat16)
    with KVClient(a.address) as ca, KVClient(b.address) as cb:
        r = ca.store(MODEL, tokens_of(1), layers)
        assert r.chunk_key == chunk_key(MODEL, tokens_of(1)) and r.variant_id == variant_id(r.chunk_key, [])
        wait_listed(view, r.chunk_key, r.variant_id)
        assert not cb.lookup(MODEL, tokens_of(1)).found  # B knows nothing of it yet
        plan = cb.plan(MODEL, [tokens_of(1)], question_tokens=8)
        (c,) = plan.chunks
        assert c.variant_id == r.variant_id and c.tier == "remote" and c.source != pb.ChunkPlan.FRESH
        assert plan.computed_tokens < 24 and plan.lease_id
        assert_bit_identical([(f.key, f.value) for f in cb.fetch_layers([Ref(r.chunk_key, r.variant_id)])], layers)
        cb.release(plan.lease_id)
        entry = next(e for e in view.discover([r.chunk_key]) if e.info.variant_id == r.variant_id)
        assert entry.holder == a.address  # the global view names the node that stored it


def test_altered_remote_payload_is_never_served(nodes, view, cluster):
    a, b = nodes
    layers = random_layers(2, (2, 24, 16), SPEC.num_layers, torch.bfloat16)
    with KVClient(a.address) as ca, KVClient(b.address) as cb:
        r = ca.store(MODEL, tokens_of(2), layers)
        wait_listed(view, r.chunk_key, r.variant_id)
        # Flip one payload byte of the object in the cluster (header left intact).
        client = view.client
        key = view.payload_of(next(e for e in view.discover([r.chunk_key]) if e.info.variant_id == r.variant_id))
        raw = bytearray(client.get_many([key])[0])
        raw[-100] ^= 0x40
        client.remove(key)
        client.begin_put(key, len(raw))
        client.put_range(key, 0, [raw])
        client.end_put(key)
        plan = cb.plan(MODEL, [tokens_of(2)], question_tokens=8)
        assert plan.chunks[0].variant_id == r.variant_id  # listed, so planned ...
        with pytest.raises(NotFoundError):  # ... but its bytes never come back
            list(cb.fetch_layers([Ref(r.chunk_key, r.variant_id)]))
        cb.release(plan.lease_id)
        assert not cb.lookup(MODEL, tokens_of(2)).found
        assert view.discover([r.chunk_key]) == []  # list entry dropped
        assert client.get_many([key]) == [b""]  # object deleted
        # Node A's own copy (host/disk) is untouched.
        assert_bit_identical(ca.fetch(r.chunk_key), layers)


def test_variant_demoted_out_of_local_tiers_comes_back_from_remote(cluster, tmp_path):
    """No write-through; a disk budget of one variant: storing a second pushes the
    first out of host and disk into the cluster (the tier list's one-down move)."""
    layers = [random_layers(10 + i, (2, 24, 16), SPEC.num_layers, torch.bfloat16) for i in range(2)]
    size = sum(k.numel() * 2 * 2 for k, _ in layers[0])
    node = ServiceProcess(tmp_path / "node-c", host_budget_bytes=1, disk_budget_bytes=size + size // 2,
                          **remote_settings(cluster.master, remote_write_through=False)).start()
    try:
        with KVClient(node.address) as c:
            r0 = c.store(MODEL, tokens_of(10), layers[0])
            assert [t.name for t in c.stats().tiers] == ["host", "disk", "remote"]
            r1 = c.store(MODEL, tokens_of(11), layers[1])
            (info,) = c.get_chunk(r0.chunk_key)
            assert info.tier == "remote"  # demoted: only the cluster holds it now
            tiers = {t.name: t for t in c.stats().tiers}
            assert tiers["disk"].variants == 1 and tiers["remote"].bytes_used == size
            assert_bit_identical(c.fetch(r0.chunk_key), layers[0])
            assert_bit_identical(c.fetch(r1.chunk_key), layers[1])
            assert {t.name: t.hits for t in c.stats().tiers}["remote"] >= SPEC.num_layers
    finally:
        node.stop()
        node.close()


def _fetch_all_or_not_found(c: KVClient, refs, want) -> tuple[int, int]:
    """Fetch each variant alone: (correct, not found); anything else fails the test."""
    ok = missing = 0
    for ref, layers in zip(refs, want):
        try:
            got = [(f.key, f.value) for f in c.fetch_layers([ref])]
        except NotFoundError:
            missing += 1
            continue
        assert_bit_identical(got, layers)
        ok += 1
    return ok, missing


def test_master_killed_mid_fetch_then_restarted(nodes, view, cluster):
    """Last of the module's tests on the shared cluster: it takes the master down."""
    a, b = nodes
    n, unread = 12, 3
    remote_layers = [random_layers(100 + i, (2, 512, 16), SPEC.num_layers, torch.bfloat16)
                     for i in range(n + unread)]  # 4 x 64 KiB layers each
    own_layers = random_layers(99, (2, 24, 16), SPEC.num_layers, torch.bfloat16)
    with KVClient(a.address) as ca, KVClient(b.address) as cb:
        stored = [ca.store(MODEL, tokens_of(100 + i, 512), remote_layers[i]) for i in range(n + unread)]
        own = cb.store(MODEL, tokens_of(99), own_layers)
        for r in stored:
            wait_listed(view, r.chunk_key, r.variant_id)
        plan = cb.plan(MODEL, [tokens_of(100 + i, 512) for i in range(n + unread)], question_tokens=8)
        assert plan.lease_id  # B planned with (and leased) what A stored ...
        tiers = [[i.tier for i in cb.get_chunk(r.chunk_key)] for r in stored]
        assert tiers == [["remote"]] * (n + unread)  # ... remote-only
        refs = [Ref(r.chunk_key, r.variant_id) for r in stored]
        stream = iter(cb.fetch_layers(refs[:n]))
        first = next(stream)
        assert_bit_identical([(first.key, first.value)], [remote_layers[first.index][first.layer]])
        assert ca.stats().cluster.master_up and cb.stats().cluster.master_up and master_up_gauge(a) == 1.0
        cluster.master.kill()
        # The stream B had under way: right bytes, or it ends NOT_FOUND (B may have read every
        # payload before the kill: its remote tier keeps what it read last).
        try:
            for f in stream:
                assert_bit_identical([(f.key, f.value)], [remote_layers[f.index][f.layer]])
        except NotFoundError:
            pass
        _fetch_all_or_not_found(cb, refs[:n], remote_layers[:n])
        # What B never read needs the master to be found: NOT_FOUND, never an error or wrong bytes.
        assert _fetch_all_or_not_found(cb, refs[n:], remote_layers[n:]) == (0, unread)
        for c, node in ((ca, a), (cb, b)):
            wait_for(lambda: not c.stats().cluster.master_up, f"{node.address} saying its master is down", 10)
        assert master_up_gauge(a) == 0.0
        # Both nodes keep serving their local tiers, and B keeps planning.
        assert_bit_identical(cb.fetch(own.chunk_key), own_layers)
        for r, layers in zip(stored, remote_layers):
            assert_bit_identical(ca.fetch(r.chunk_key), layers)
        assert cb.plan(MODEL, [tokens_of(99)], question_tokens=8).chunks[0].variant_id == own.variant_id

        # Restart: the same address, an empty cluster; the nodes rejoin on their own.
        cluster.master.start()
        layers = random_layers(7, (2, 24, 16), SPEC.num_layers, torch.bfloat16)
        deadline = time.monotonic() + 60
        new = ca.store(MODEL, tokens_of(7), layers)
        while new.variant_id not in {e.info.variant_id for e in view.discover([new.chunk_key])}:
            if time.monotonic() > deadline:
                raise AssertionError("node A did not write to the restarted master within 60s")
            # a write-through attempted before A rejoined is lost: store another variant
            ca.evict(chunk_key=new.chunk_key)
            new = ca.store(MODEL, tokens_of(7), layers)
            time.sleep(0.2)
        # B rejoins on its own too, maybe later than A: until its client reaches the new master
        # (Stats says its master is down) its view is empty and it plans the chunk fresh (never an error).
        while not cb.stats().cluster.master_up:
            plan = cb.plan(MODEL, [tokens_of(7)], question_tokens=8)
            assert plan.chunks[0].source == pb.ChunkPlan.FRESH or cb.stats().cluster.master_up, plan
            assert time.monotonic() < deadline, "node B did not reach the restarted master within 60s"
            time.sleep(0.2)
        plan = cb.plan(MODEL, [tokens_of(7)], question_tokens=8)
        assert plan.chunks[0].variant_id == new.variant_id and plan.chunks[0].tier == "remote", plan
        assert master_up_gauge(a) == 1.0
        assert_bit_identical([(f.key, f.value) for f in cb.fetch_layers([Ref(new.chunk_key, new.variant_id)])], layers)
