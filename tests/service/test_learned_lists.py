"""Learned recompute lists (VariantStats.recompute_scores) through the real server:
they rank the plan's recompute tokens, survive a restart with the variant's metadata,
and go when the variant goes."""

from __future__ import annotations

import pytest

from kvclient.client import KVClient
from kvclient.errors import InvalidArgumentError
from kvcraft.keys import ModelSpec
from kvcraft.records import VariantStats
from kvcraft.v1 import kvcraft_pb2 as pb
from tests.conftest import random_layers

MODEL_SHAPE = dict(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32")  # `model`: the same under a name of its own
MODEL = ModelSpec("learned-test", **MODEL_SHAPE).fingerprint()
T = 20  # tokens per chunk
TIA = tuple(0.9 - 0.04 * t for t in range(T))  # eq. 14 ranks 0, 1, 2, ...
LEARNED = tuple({4: 2.0, 2: 0.3, 11: 0.1}.get(t, 0.0) for t in range(T))  # learned: 4, 2, 11; the rest cost nothing


def tokens(i: int) -> list[int]:
    return [i * 100 + t for t in range(T)]


def recompute(c: KVClient, key: str, *more: int) -> list[int]:
    """The plan's recompute list of chunk `key`, placed behind a chunk it was not stored behind."""
    plan = c.plan(MODEL, [tokens(9), tokens(1), *map(tokens, more)], question_tokens=4, first_turn=False)
    c.release(plan.lease_id)
    (cp,) = [cp for cp in plan.chunks if cp.chunk_key == key]
    assert cp.source == pb.ChunkPlan.VARIANT
    return list(cp.recompute)


def test_learned_scores_rank_recompute_survive_restart_and_go_with_the_variant(start_server):
    # No host tier (a 1-byte budget): after the restart a Plan would otherwise start copying
    # v1 from disk into host memory in the background, and that copy holds v1, so the Evict
    # below could find it protected (skipped) on a slow machine.
    server = start_server(host_budget_bytes=1)
    with KVClient(server.address) as c:
        k0 = c.store(MODEL, tokens(0), random_layers(0, (1, T, 4))).chunk_key
        stats = VariantStats(a=0.5, b=0.1, prefix_attention=(0.5,), token_inter_attention=TIA,
                             recompute_scores=LEARNED)
        v1 = c.store(MODEL, tokens(1), random_layers(1, (1, T, 4)), prefix_keys=[k0], stats=stats)
        before = recompute(c, v1.chunk_key)
        # the controller's ratio (>= 15%: >= 3 of 20 tokens) on the learned scores, highest
        # first, never a token scored 0; not eq. 14's 0, 1, 2, ...
        assert before == [4, 2, 11]
    server.restart()
    with KVClient(server.address) as c:
        (info,) = c.get_chunk(v1.chunk_key)
        assert list(info.stats.recompute_scores) == pytest.approx(LEARNED)
        assert recompute(c, v1.chunk_key) == before
        assert c.evict(variant_id=v1.variant_id).evicted == 1
        assert not c.lookup(chunk_key=v1.chunk_key).found
        # The same chunk stored again without a learned list: eq. 14 again, nothing left over.
        c.store(MODEL, tokens(1), random_layers(1, (1, T, 4)), prefix_keys=[k0],
                stats=VariantStats(a=0.5, b=0.1, prefix_attention=(0.5,), token_inter_attention=TIA))
        (info,) = c.get_chunk(v1.chunk_key)
        assert list(info.stats.recompute_scores) == []
        again = recompute(c, v1.chunk_key)
        assert again and again == list(range(len(again)))  # eq. 14 order, sized by CFO


def test_the_plan_spends_one_budget_on_the_highest_learned_scores_of_the_prompt(shared_server, model):
    """Two learned variants in one prompt: the controller's ratio r of their 40 tokens
    goes to the highest scores of both (a prompt-wide budget, not N per chunk)."""
    with KVClient(shared_server.address) as c:
        k0 = c.store(model, tokens(0), random_layers(0, (1, T, 4))).chunk_key
        strong = tuple(float(T - t) for t in range(T))  # every token of chunk 1 outranks chunk 3's
        weak = tuple(0.5 if t < 3 else 0.0 for t in range(T))
        for i, sc in ((1, strong), (3, weak)):
            c.store(model, tokens(i), random_layers(i, (1, T, 4)), prefix_keys=[k0], stats=VariantStats(
                a=0.5, b=0.1, prefix_attention=(0.5,), token_inter_attention=TIA, recompute_scores=sc))
        plan = c.plan(model, [tokens(9), tokens(1), tokens(3)], question_tokens=4, first_turn=False)
        c.release(plan.lease_id)
        lists = {cp.chunk_key: list(cp.recompute) for cp in plan.chunks}
        k1, k3 = (c.lookup(model, tokens(i)).chunk_key for i in (1, 3))
        n = int(plan.ratio * 2 * T + 1e-6)  # floor(r x reused learned tokens)
        assert 0 < n < T
        assert lists[k1] == list(range(n)) and lists[k3] == []


def test_recompute_scores_of_the_wrong_length_are_refused(shared_server, model):
    with KVClient(shared_server.address) as c:
        with pytest.raises(InvalidArgumentError, match="recompute_scores has 2 values for 20 tokens"):
            c.store(model, tokens(2), random_layers(2, (1, T, 4)), stats=VariantStats(recompute_scores=(1.0, 2.0)))


def test_a_variant_without_scores_borrows_its_siblings(shared_server, model):
    """Scores are learned on the variant a request stores; the chunk's older variant, chosen
    by the planner for another prefix, recomputes by them too."""
    with KVClient(shared_server.address) as c:
        k0 = c.store(model, tokens(0), random_layers(0, (1, T, 4))).chunk_key
        plain = c.store(model, tokens(1), random_layers(1, (1, T, 4)), prefix_keys=[k0], stats=VariantStats(
            a=0.2, b=0.5, prefix_attention=(0.2,), token_inter_attention=TIA))
        k5 = c.store(model, tokens(5), random_layers(5, (1, T, 4))).chunk_key
        c.store(model, tokens(1), random_layers(2, (1, T, 4)), prefix_keys=[k5], stats=VariantStats(
            a=0.9, b=0.01, prefix_attention=(0.9,), token_inter_attention=TIA, recompute_scores=LEARNED))
        assert len(c.get_chunk(plain.chunk_key)) == 2
        plan = c.plan(model, [tokens(9), tokens(1)], question_tokens=4, first_turn=False)
        c.release(plan.lease_id)
        (cp,) = [cp for cp in plan.chunks if cp.chunk_key == plain.chunk_key]
        assert cp.variant_id == plain.variant_id  # the lower-CFO variant, stored without scores
        assert list(cp.recompute) == [4, 2, 11]  # ranked by its sibling's learned scores


def test_the_plan_merges_the_scores_of_every_variant_of_the_chunk(shared_server, model):
    """Each variant holds what the request that stored it learned (often about another
    question); the plan ranks by their elementwise maximum."""
    with KVClient(shared_server.address) as c:
        k0 = c.store(model, tokens(0), random_layers(0, (1, T, 4))).chunk_key
        k5 = c.store(model, tokens(5), random_layers(5, (1, T, 4))).chunk_key
        k6 = c.store(model, tokens(6), random_layers(6, (1, T, 4))).chunk_key
        first = tuple({4: 2.0}.get(t, 0.0) for t in range(T))
        second = tuple({2: 0.3, 11: 0.1}.get(t, 0.0) for t in range(T))
        chosen = c.store(model, tokens(1), random_layers(1, (1, T, 4)), prefix_keys=[k0], stats=VariantStats(
            a=0.2, b=0.5, prefix_attention=(0.2,), token_inter_attention=TIA, recompute_scores=first))
        for k, sc in ((k5, second), (k6, ())):
            c.store(model, tokens(1), random_layers(k == k5 and 2 or 3, (1, T, 4)), prefix_keys=[k], stats=VariantStats(
                a=0.9, b=0.01, prefix_attention=(0.9,), token_inter_attention=TIA, recompute_scores=sc))
        plan = c.plan(model, [tokens(9), tokens(1)], question_tokens=4, first_turn=False)
        c.release(plan.lease_id)
        (cp,) = [cp for cp in plan.chunks if cp.chunk_key == chosen.chunk_key]
        assert cp.variant_id == chosen.variant_id
        assert list(cp.recompute) == [4, 2, 11]  # its own 4, then its siblings' 2 and 11
