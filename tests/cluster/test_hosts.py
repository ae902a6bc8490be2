"""kvcraft nodes on separate (simulated) hosts sharing one Mooncake cluster, through node
deaths, a partition and a master restart (docs/scale-out.md, "Across hosts").

The tests run in this order on one cluster (tests/cluster/conftest.py): each fault leaves
the cluster as the next test expects it. Every engine answer is checked against the same
engine's full prefill of the prompt: reuse must never change an answer here (every
variant reused is prefix-exact), whatever failed.
"""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvclient.client import KVClient
from tests.cluster.conftest import CLIENT_TTL_S, NODES, wait_for
from tests.cluster.helpers import all_listed, assert_right, chunk_vids, chunks_listed, compute, wait_master

pytestmark = pytest.mark.slow

# Prompts (held-out draws of tests.cluster.engine_worker) each test computes first.
FIRST_A = range(0, 4)  # engine A computes; B reuses through the cluster
PARTITIONED = range(4, 8)  # engine B computes; A reads them while B is cut off
KILLED = range(8, 12)  # engine B computes; A and C read them after B is killed
LATE_A = range(12, 13)  # engine A computes after the master restart


def test_chunks_computed_on_a_are_reused_on_b_with_a_s_answers(cluster):
    mine = compute(cluster, "a", FIRST_A)
    assert all(r["fresh"] == r["chunks"] for r in mine)
    held = chunk_vids(cluster, "a")
    wait_for("A's variants listed in the cluster", lambda: all_listed(cluster, held), 30)
    engine_b, node_b = cluster.engines["b"], cluster.address("b")
    for p, a in zip(FIRST_A, mine):
        r = engine_b.prefill(node_b, p)
        cluster.saw("none: B reuses what A computed", [r])
        assert r["reused"] == r["chunks"] and r["fresh"] == 0 and r["fallbacks"] == 0, r
        assert r["answer"] == a["answer"], (r, a)
        assert_right(r)
        assert r["max_logit_diff"] < 1e-3, r  # every variant prefix-exact: the same KV as A's prefill


def test_an_engine_whose_service_is_on_another_host_streams_and_says_so_once(cluster):
    """Engine A served by node B (another host): shared memory is declined once, then
    every layer streams over gRPC; the answers are unchanged."""
    engine_a, node_b = cluster.engines["a"], cluster.address("b")
    first, second = (engine_a.prefill(node_b, p) for p in FIRST_A[:2])
    cluster.saw("engine A served by node B (another host)", [first, second])
    assert first["tried_local"] and not first["local_after"], first  # tried once, told it is remote
    assert not second["tried_local"], second  # never again
    for r in (first, second):
        assert r["reused"] == r["chunks"] and r["fallbacks"] == 0, r
        assert_right(r)
    assert engine_a.log().count("shared memory is not on this host") == 1, engine_a.log()[-2000:]


def on_segment_of(cluster, host: str, prompts) -> dict[int, list[str]]:
    """Engine `host` computes `prompts` through its node: prompt -> the variant ids of it
    whose cluster copy lies in `host`'s own segment (the only copy: Mooncake keeps one
    replica). At least one prompt has one."""
    computed = compute(cluster, host, prompts)
    assert all(r["fresh"] > 0 for r in computed)  # (a chunk another prompt shares, at its place, is reused)
    keys = {k for r in computed for k in r["chunk_keys"]}
    held = {k: vs for k, vs in chunk_vids(cluster, host).items() if k in keys}
    wait_for(f"{host}'s variants listed", lambda: all_listed(cluster, held), 30)
    where = cluster.net.address(host) + ":"
    payload = {e.info.variant_id: cluster.view.payload_of(e) for e in cluster.view.discover(list(keys))}
    out: dict[int, list[str]] = {}
    for p, r in zip(prompts, computed):
        vids = [v for k in r["chunk_keys"] for v in held[k]]
        if mine := [v for v in vids if cluster.view.client.placement(payload[v]).startswith(where)]:
            out[p] = mine
    assert out, f"none of {host}'s variants was placed in its own segment: the test would test nothing"
    return out


def probe(address: str) -> float:
    """Seconds the node takes to answer a health check and a read of a local variant."""
    t0 = time.monotonic()
    with grpc.insecure_channel(address) as ch:
        got = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert got.status == health_pb2.HealthCheckResponse.SERVING
    with KVClient(address, timeout=5) as c:
        key = next(ch.chunk_key for ch in c.list_chunks().chunks
                   if any(v.tier in ("host", "disk") for v in c.get_chunk(ch.chunk_key)))
        assert len(c.fetch(key)) > 0
    return time.monotonic() - t0


def test_a_partition_of_b_mid_fetch_leaves_a_answering(cluster):
    """B's link goes down while engine A reads variants whose only copy is in B's segment:
    A's requests finish (recomputing what could not be read) and node A keeps answering
    health checks and local reads throughout."""
    on_b = on_segment_of(cluster, "b", PARTITIONED)
    engine_a, node_a = cluster.engines["a"], cluster.address("a")
    slowest_probe = 0.0
    cluster.net.link_down("b")
    try:
        for p in on_b:
            engine_a.send(service=node_a, prompt=p)
            slowest_probe = max(slowest_probe, probe(node_a))
            r = engine_a.result(timeout=90)
            cluster.saw("B's link down: A reads B's segment", [r])
            assert_right(r)
            assert r["fresh"] + r["fallbacks"] > 0, r  # what lay in B's segment was computed here
            assert r["ttft_s"] < 30, r
            slowest_probe = max(slowest_probe, probe(node_a))
    finally:
        cluster.net.link_up("b")
    assert slowest_probe < 2.0, slowest_probe
    engine_a.flush(node_a)


def test_node_b_killed_its_objects_are_recomputed_never_served_wrong_and_leave_the_view(cluster):
    """SIGKILL node B while engines on A and C read variants whose only copy was in B's
    segment: NOT_FOUND and recompute, right answers; B's objects leave the global view once
    the master's client_ttl has passed."""
    on_b = on_segment_of(cluster, "b", KILLED)
    gone = {v for vs in on_b.values() for v in vs}
    cluster.nodes["b"].kill()
    t_kill = time.monotonic()
    for host in ("a", "c"):
        engine, node = cluster.engines[host], cluster.address(host)
        for p in on_b:
            r = engine.prefill(node, p, timeout=90)
            cluster.saw("B killed (SIGKILL): A and C read B's segment", [r])
            assert_right(r)
            assert r["ttft_s"] < 30, r
    chunk_keys = list({k for p in on_b for k in engine.prefill(cluster.address("c"), p)["chunk_keys"]})
    b_node, b_segment = cluster.address("b"), cluster.net.address("b") + ":"

    def b_listed() -> list:
        """Listed entries of B's variants that B published, whose payload lies in B's segment,
        or whose payload is stored nowhere (A and C store the same variant ids back as they
        recompute: listed with a payload of theirs, those stay)."""
        client, view = cluster.view.client, cluster.view
        return [e for e in view.discover(chunk_keys) if e.info.variant_id in gone and (
            e.holder == b_node or not client.exists([view.payload_of(e)])[0]
            or client.placement(view.payload_of(e)).startswith(b_segment))]

    wait_for("B's objects gone from the view", lambda: not b_listed() or None, CLIENT_TTL_S + 10)
    assert time.monotonic() - t_kill < CLIENT_TTL_S + 10
    for host in ("a", "c"):
        cluster.engines[host].flush(cluster.address(host))


def test_b_rejoins_with_its_disk_and_serves_its_variants_again(cluster):
    """B restarted on its data dir (same address): its engine reuses what B stored before
    it was killed, from B's own disk."""
    cluster.nodes["b"].restart()
    # what B recovered from its disk (variants known only from the cluster are not kept)
    recovered = {k for k, vids in chunk_vids(cluster, "b").items() if vids}
    assert recovered
    engine_b, node_b = cluster.engines["b"], cluster.address("b")
    for p in KILLED:
        r = engine_b.prefill(node_b, p)
        cluster.saw("B restarted on its disk", [r])
        mine = [k for k in r["chunk_keys"] if k in recovered]
        assert mine and r["reused"] >= len(mine), (r, len(mine))  # every chunk B kept is reused
        assert_right(r)


def test_master_killed_and_restarted_nodes_rejoin_without_a_restart(cluster):
    """The master dies: nodes keep serving from their own tiers. It comes back on the same
    address, empty: the nodes rejoin by themselves and the cluster fills again."""
    cluster.master.kill()
    engine_a, node_a = cluster.engines["a"], cluster.address("a")
    for p in FIRST_A:  # A's own variants, from its own tiers (whether or not A noticed yet)
        r = engine_a.prefill(node_a, p)
        cluster.saw("master killed: A serves its own variants", [r])
        assert r["reused"] == r["chunks"] and r["fallbacks"] == 0, r
        assert_right(r)
    wait_master(cluster, NODES, False, 10)
    cluster.master.start()
    # The nodes rejoin by themselves and put back what they hold: every chunk A holds is
    # listed again (a chunk's list has remote_list_slots entries, so two variants of one
    # chunk can share an entry: the chunk, not each variant, is what must come back).
    held = chunk_vids(cluster, "a", local=True)
    wait_for("the restarted master refilled from the nodes", lambda: chunks_listed(cluster, held), 60)
    wait_master(cluster, ["c"], True, 30)  # until C's client reaches the new master, C plans from its own tiers
    engine_c, node_c = cluster.engines["c"], cluster.address("c")
    refilled = engine_c.prefill(node_c, FIRST_A[0])  # C never computed it: it reads the refilled cluster
    (late,) = compute(cluster, "a", [LATE_A[0]])  # stored after the restart
    wait_for("A's new chunks listed", lambda: chunks_listed(cluster, late["chunk_keys"]), 30)
    after = engine_c.prefill(node_c, LATE_A[0])
    cluster.saw("master restarted: C reads what A held before and wrote after", [refilled, after])
    for r in (refilled, after):
        assert r["reused"] == r["chunks"] and r["fresh"] == 0, r
        assert_right(r)
