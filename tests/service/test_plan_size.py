"""What a Plan response costs on the wire, per chunk (kvcraft.v1.ChunkPlan, kvcraft/plans.py).

A chunk's fields are fixed-size but for its recompute list: chunk_key and variant_id
(32 chars + 2 bytes of tag and length each), its key in `order` (34), position,
token_start, token_count, source, cfo (5), tier (6), the variant prefix's chain and
length (2-4), the message's own tag and length (2-3): about 140 bytes, so 160 bounds it;
each recompute index is a varint of at most 2 bytes (chunks under 16,384 tokens). The
response's own fields (lease, estimates) and its prefix chains are amortized across the
chunks, and the conversation's history costs 34 bytes a key once per response.
Before the key table, every chunk carried its prompt prefix and its variant's prefix as
keys: 8.8 KB a chunk for 256 chunks stored behind one another.
"""

from __future__ import annotations

import random

import pytest

from kvcraft.keys import ModelSpec
from kvcraft.plans import KeyTable, prefix_keys, variant_prefixes
from kvcraft.records import VariantStats
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.config import load_config
from kvservice.index import Spec
from kvservice.planning import PlanningService
from kvservice.records import StoreHeader
from kvservice.store import ChunkStore

MODEL = ModelSpec("plan-size", 1, 1, 2, "float32").fingerprint()
N, TOKENS = 256, 64
CHUNK_BYTES = 160  # fixed fields of one chunk, its key in `order` included (module docstring)
RECOMPUTE_BYTES = 2  # one recompute index: a varint below 16,384


def _tokens(i: int) -> list[int]:
    return [i * 1000 + t for t in range(TOKENS)]


@pytest.fixture(scope="module")
def planning(tmp_path_factory):
    """256 chunks, each stored behind every chunk before it (as one long request
    stores them), with statistics, so a reorder makes every one a VARIANT."""
    store = ChunkStore(load_config(env={}, overrides={"data_dir": str(tmp_path_factory.mktemp("data")),
                                                      "max_fetch_variants": 1024}))
    keys: list[str] = []
    for i in range(N):
        spec = Spec(pb.FLOAT32, (1, TOKENS, 2))
        stats = VariantStats(a=0.3, b=0.6, prefix_attention=tuple([0.01] * i),
                             token_inter_attention=tuple(float(t % 7) for t in range(TOKENS)))
        s = store.begin_store(StoreHeader(MODEL, _tokens(i), tuple(keys), 1, spec, spec, stats))
        s.add_layer(0, bytes(TOKENS * 8), bytes(TOKENS * 8))
        keys.append(s.finish().chunk_key)
    yield PlanningService(store), store, keys
    store.close()


def _plan(svc: PlanningService, order: list[int], conv: str = "") -> pb.PlanResponse:
    return svc.plan(pb.PlanRequest(model_id=MODEL, chunks=[pb.PlanChunk(token_ids=_tokens(i)) for i in order],
                                   question_tokens=16, conversation_id=conv, first_turn=False))


def _bound(plan: pb.PlanResponse) -> int:
    """What the response may cost: the fixed part, the history, then per chunk."""
    history = sum(len(k) + 2 for k in plan.history)
    chains = sum(pb.KeyChain(ranges=c.ranges).ByteSize() + 3 for c in plan.variant_prefixes)
    recompute = sum(len(c.recompute) for c in plan.chunks)
    return 200 + history + chains + CHUNK_BYTES * len(plan.chunks) + RECOMPUTE_BYTES * recompute


@pytest.mark.parametrize("shuffle", [False, True], ids=["stored-order", "reordered"])
def test_a_plan_costs_a_bounded_number_of_bytes_per_chunk_and_names_every_prefix(planning, shuffle):
    svc, store, keys = planning
    order = list(range(N))
    if shuffle:
        random.Random(7).shuffle(order)
    plan = _plan(svc, order)
    try:
        assert len(plan.chunks) == N and all(c.variant_id for c in plan.chunks)
        size = plan.ByteSize()
        assert size <= _bound(plan), (size, _bound(plan))
        # Nested prefixes share one chain: a few hundred bytes, not a key per chunk before each.
        assert sum(c.ByteSize() for c in plan.variant_prefixes) < 4 * N
        assert size / N < CHUNK_BYTES + 20, size / N
        for c, behind in zip(plan.chunks, variant_prefixes(plan)):
            stored = keys.index(c.chunk_key)
            assert behind == tuple(keys[:stored])  # what the variant was computed behind
            assert prefix_keys(plan, c) == list(plan.order[: c.position])  # where a new one would go
    finally:
        store.release(plan.lease_id)


def test_a_conversations_history_is_sent_once_per_response_not_per_chunk(planning):
    svc, store, _ = planning
    for turn in range(6):
        plan = _plan(svc, list(range(turn * 40, turn * 40 + 40)), conv="talk")
        store.release(plan.lease_id)
    assert len(plan.history) == 200
    assert plan.ByteSize() <= _bound(plan)
    assert plan.ByteSize() - sum(len(k) + 2 for k in plan.history) < (CHUNK_BYTES + 20) * 40
    assert prefix_keys(plan, plan.chunks[3]) == [*plan.history, *plan.order[:3]]


def test_key_chains_decode_to_the_prefixes_they_encode():
    rng = random.Random(3)
    pool = [f"{i:032x}" for i in range(60)]
    history, order = pool[:10], pool[10:30]
    table = KeyTable(history, order)
    resp = pb.PlanResponse(history=history, order=order)
    want = []
    for position in range(len(order)):
        kind = rng.randrange(4)
        if kind == 0:
            prefix = []
        elif kind == 1:  # exact: behind this very prompt prefix
            prefix = history + order[:position]
        else:  # any keys, some in neither history nor order
            prefix = rng.sample(pool, rng.randrange(1, 25))
        chain, length = table.chain(prefix)
        resp.chunks.add(position=position, variant_prefix_chain=chain, variant_prefix_length=length)
        want.append(tuple(prefix))
    resp.other_keys.extend(table.other)
    for ranges in table.chain_ranges():
        resp.variant_prefixes.add(ranges=ranges)
    assert variant_prefixes(pb.PlanResponse.FromString(resp.SerializeToString())) == want
    resp.chunks[1].variant_prefix_chain = len(resp.variant_prefixes) + 1
    with pytest.raises(ValueError, match="variant_prefixes"):
        variant_prefixes(resp)
