"""Plan over gRPC against a real server with real stored variants."""

from __future__ import annotations

import time

import pytest

from kvclient.client import KVClient
from kvclient.errors import InvalidArgumentError, ResourceExhaustedError
from kvcraft.keys import ModelSpec, chunk_key
from kvcraft.plans import prefix_keys, variant_prefixes
from kvcraft.records import VariantStats
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.planner import ChunkRef, InMemoryCatalog, Planner, Variant
from tests.conftest import random_layers

MODEL_SHAPE = dict(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32")  # `model`: the same under a name of its own
MODEL = ModelSpec("plan-test", **MODEL_SHAPE).fingerprint()


def chunk_tokens(i: int, n: int = 6) -> list[int]:
    return [i * 10 + t for t in range(n)]


def test_plan_leases_reused_variants_until_release(start_server):
    size = 2 * 2 * 6 * 4 * 4
    server = start_server(disk_budget_bytes=2 * size)
    with KVClient(server.address) as c:
        # chunk 1 computed behind chunk 0, with statistics; chunk 0 alone
        # (a chunk computed alone: a = 0; with b > 0, CCI = sigmoid(0) = 0.5 and CFO < 1)
        k0 = c.store(MODEL, chunk_tokens(0), random_layers(0, (1, 6, 4)), stats=VariantStats(a=0.0, b=0.5)).chunk_key
        stats = VariantStats(a=0.3, b=0.6, prefix_attention=(0.3,), token_inter_attention=(0.1, 0.9, 0.2, 0.8, 0.0, 0.5))
        v1 = c.store(MODEL, chunk_tokens(1), random_layers(1, (1, 6, 4)), prefix_keys=[k0], stats=stats)
        plan = c.plan(MODEL, [chunk_tokens(1), chunk_tokens(0), chunk_tokens(2)], question_tokens=5)
        assert plan.lease_id
        by_key = {cp.chunk_key: cp for cp in plan.chunks}
        assert by_key[v1.chunk_key].source == pb.ChunkPlan.VARIANT
        assert by_key[v1.chunk_key].variant_id == v1.variant_id
        assert by_key[k0].source == pb.ChunkPlan.VARIANT
        assert by_key[chunk_key(MODEL, chunk_tokens(2))].source == pb.ChunkPlan.FRESH
        # the recompute set is the top tokens by stored inter-attention (eq. 14)
        rc = list(by_key[v1.chunk_key].recompute)
        assert rc == [1, 3, 5, 2, 0, 4][: len(rc)]

        # Pressure: the disk holds exactly these two, both leased by the plan, so a
        # store that needs room is refused rather than evicting them.
        with pytest.raises(ResourceExhaustedError, match="leased or pinned"):
            c.store(MODEL, chunk_tokens(3), random_layers(3, (1, 6, 4)))
        assert c.fetch(k0) and c.fetch(v1.chunk_key, v1.variant_id)

        assert c.release(plan.lease_id)
        c.store(MODEL, chunk_tokens(3), random_layers(3, (1, 6, 4)))  # now the policy may evict one
        assert sum(bool(c.lookup(chunk_key=k).found) for k in (k0, v1.chunk_key)) == 1


def test_plan_over_grpc_matches_the_in_process_planner(shared_server, model):
    """Same stored variants, same request sequence: the service answers what a planner
    built from scratch beside it answers."""
    catalog = InMemoryCatalog()
    ref = Planner(catalog)
    catalog.listeners.append(ref)
    keys = [chunk_key(model, chunk_tokens(i)) for i in range(6)]
    with KVClient(shared_server.address) as c:
        for i in (0, 2, 4):
            r = c.store(model, chunk_tokens(i), random_layers(i, (1, 6, 4)))
            catalog.put(Variant.build(r.variant_id, r.chunk_key, (), 6, "host", VariantStats()))
        requests = [[0, 1, 2], [2, 0, 3], [4, 2, 0, 5], [1, 0, 2], [0, 2, 4]]
        for n, idx in enumerate(requests):
            conv = f"{model}-c{n % 2}"  # conversations are the service's, across models: ids of this test's own
            got = c.plan(model, [(keys[i], 6) for i in idx], question_tokens=4, conversation_id=conv)
            c.release(got.lease_id) if got.lease_id else None
            want = ref.plan(model, conv, [ChunkRef(keys[i], 6) for i in idx], 4)
            assert list(got.order) == list(want.order)
            assert list(got.dropped) == list(want.dropped)
            assert [(cp.source, cp.variant_id, list(cp.recompute)) for cp in got.chunks] == [
                ({"fresh": 1, "prefix": 2, "variant": 3}[w.source], w.variant_id or "", list(w.recompute))
                for w in want.chunks]
            assert got.preload_depth == want.preload_depth


def test_second_turn_drops_chunks_already_sent(shared_server, model):
    conv = f"conv-{model}"  # conversations are the service's, across models: an id of this test's own
    with KVClient(shared_server.address) as c:
        t1 = c.plan(model, [chunk_tokens(0), chunk_tokens(1)], 3, conversation_id=conv)
        t2 = c.plan(model, [chunk_tokens(1), chunk_tokens(2)], 3, conversation_id=conv)
    assert list(t2.dropped) == [chunk_key(model, chunk_tokens(1))]
    assert list(t2.order) == [chunk_key(model, chunk_tokens(2))]
    assert list(t2.history) == list(t1.order)
    assert prefix_keys(t2, t2.chunks[0]) == list(t1.order)


@pytest.mark.parametrize("kwargs,message", [
    (dict(model_id="x", chunks=[[1]]), "model_id"),
    (dict(model_id=MODEL, chunks=[]), "chunks is empty"),
    (dict(model_id=MODEL, chunks=[("abc", 3)]), r"chunks\[0\] needs token_ids"),
    (dict(model_id=MODEL, chunks=[("0" * 32, 0)]), r"chunks\[0\].token_count is 0"),
])
def test_malformed_plan_is_invalid_argument(shared_server, kwargs, message):
    with KVClient(shared_server.address) as c:
        with pytest.raises(InvalidArgumentError, match=message):
            c.plan(question_tokens=1, **kwargs)


@pytest.mark.parametrize("claimed", [1, 5, 7, 100])
def test_a_chunk_named_by_key_with_another_count_than_it_is_stored_with_is_refused(shared_server, model, claimed):
    """A count that is not the stored chunk's would place its KV over other rows (a shorter claim
    was planned as a chunk-prefix reused whole): refused naming both, nothing leased; the true
    count plans its variant, and an unknown key plans fresh whatever it claims."""
    tokens = chunk_tokens(3)
    with KVClient(shared_server.address) as c:
        key = c.store(model, tokens, random_layers(3, (1, 6, 4))).chunk_key
        leases = c.stats().leases
        with pytest.raises(InvalidArgumentError, match=rf"chunks\[1\] has token_count {claimed}, but chunk {key} "
                                                       r"is stored with 6 tokens"):
            c.plan(model, [chunk_tokens(4), (key, claimed)], 3)
        assert c.stats().leases == leases
        p = c.plan(model, [(key, 6)], 3)
        assert p.chunks[0].variant_id and p.chunks[0].token_count == 6
        c.release(p.lease_id)
        assert c.plan(model, [("f" * 32, claimed)], 3).chunks[0].token_count == claimed


def test_plan_names_the_prefix_each_chosen_variant_was_computed_behind(shared_server, model):
    with KVClient(shared_server.address) as c:
        k0 = c.store(model, chunk_tokens(0), random_layers(0, (1, 6, 4)), stats=VariantStats(a=0.0, b=0.5)).chunk_key
        v1 = c.store(model, chunk_tokens(1), random_layers(1, (1, 6, 4)), prefix_keys=[k0],
                     stats=VariantStats(a=0.1, b=0.8, prefix_attention=(0.1,)))
        # chunk 1 first: its variant was computed behind chunk 0, so it is not exact here
        plan = c.plan(model, [chunk_tokens(1), chunk_tokens(0)], 2, first_turn=False)
        by_key = {cp.chunk_key: cp for cp in plan.chunks}
        behind = dict(zip((cp.chunk_key for cp in plan.chunks), variant_prefixes(plan)))
        assert behind[v1.chunk_key] == (k0,)
        assert [list(c.ranges) for c in plan.variant_prefixes] == [[1, 1]]  # k0 is order[1]: table index 1
        assert prefix_keys(plan, by_key[v1.chunk_key]) == []
        assert behind[k0] == () and not plan.other_keys
        c.release(plan.lease_id)


def test_chunk_prefixes_survive_a_restart(start_server):
    """Stored chains (A alone, B behind [A]) come back as CP-Tree prefixes after a restart."""
    server = start_server()
    with KVClient(server.address) as c:
        ka = c.store(MODEL, chunk_tokens(0), random_layers(0, (1, 6, 4))).chunk_key
        vb = c.store(MODEL, chunk_tokens(1), random_layers(1, (1, 6, 4)), prefix_keys=[ka])
        c.store(MODEL, chunk_tokens(2), random_layers(2, (1, 6, 4)), prefix_keys=[chunk_key(MODEL, chunk_tokens(9))])  # broken chain
    server.restart()
    with KVClient(server.address) as c:
        plan = c.plan(MODEL, [chunk_tokens(0), chunk_tokens(1), chunk_tokens(2)], 3)
        c.release(plan.lease_id)
    assert [cp.source for cp in plan.chunks][:2] == [pb.ChunkPlan.PREFIX, pb.ChunkPlan.PREFIX]
    assert plan.chunks[1].variant_id == vb.variant_id and not plan.chunks[1].recompute
    assert plan.chunks[2].source != pb.ChunkPlan.PREFIX


def test_a_release_future_nobody_keeps_still_releases(kvserver):
    """grpcio cancels a call whose future is garbage collected before it ends; a release
    sent and forgotten (the vLLM connector's, and the PlanStream's for abandoned answers)
    must still end its lease."""
    with KVClient(kvserver.address) as c:
        c.store(MODEL, chunk_tokens(0), random_layers(0, (1, 6, 4)))
        for _ in range(20):
            c.release_future(c.plan(MODEL, [chunk_tokens(0)], question_tokens=2).lease_id)  # dropped at once
        for _ in range(200):
            if c.stats().leases == 0:
                return
            time.sleep(0.05)
        raise AssertionError(f"{c.stats().leases} of 20 leases left")
