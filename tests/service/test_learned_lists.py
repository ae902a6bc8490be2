"""Learned recompute lists (VariantStats.recompute_scores) through the real server:
they rank the plan's recompute tokens, survive a restart with the variant's metadata,
and go when the variant goes."""

from __future__ import annotations

import pytest
import torch

from kvclient.client import KVClient
from kvclient.errors import InvalidArgumentError
from kvcraft.keys import ModelSpec
from kvcraft.records import VariantStats
from kvcraft.v1 import kvcraft_pb2 as pb

MODEL = ModelSpec("learned-test", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32").fingerprint()
TIA = (0.1, 0.9, 0.2, 0.8, 0.0, 0.5)  # eq. 14 ranks 1, 3, 5, 2, 0, 4
LEARNED = (0.0, 0.0, 0.3, 0.0, 2.0, 0.0)  # learned list ranks 4, 2, then by index


def tokens(i: int) -> list[int]:
    return [i * 10 + t for t in range(6)]


def layers(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 6, 4, generator=g), torch.randn(1, 6, 4, generator=g)) for _ in range(2)]


def recompute(c: KVClient, key: str) -> list[int]:
    """The plan's recompute list of chunk `key`, placed behind a chunk it was not stored behind."""
    plan = c.plan(MODEL, [tokens(9), tokens(1)], question_tokens=4, first_turn=False)
    c.release(plan.lease_id)
    (cp,) = [cp for cp in plan.chunks if cp.chunk_key == key]
    assert cp.source == pb.ChunkPlan.VARIANT
    return list(cp.recompute)


def test_learned_scores_rank_recompute_survive_restart_and_go_with_the_variant(start_server):
    server = start_server()
    with KVClient(server.address) as c:
        k0 = c.store(MODEL, tokens(0), layers(0)).chunk_key
        stats = VariantStats(a=0.5, b=0.1, prefix_attention=(0.5,), token_inter_attention=TIA,
                             recompute_scores=LEARNED)
        v1 = c.store(MODEL, tokens(1), layers(1), prefix_keys=[k0], stats=stats)
        before = recompute(c, v1.chunk_key)
        assert before and before == [4, 2, 0, 1, 3, 5][: len(before)]  # not eq. 14's 1, 3, 5, ...
    server.restart()
    with KVClient(server.address) as c:
        (info,) = c.get_chunk(v1.chunk_key)
        assert list(info.stats.recompute_scores) == pytest.approx(LEARNED)
        assert recompute(c, v1.chunk_key) == before
        assert c.evict(variant_id=v1.variant_id)
        assert not c.lookup(chunk_key=v1.chunk_key).found
        # The same chunk stored again without a learned list: eq. 14 again, nothing left over.
        c.store(MODEL, tokens(1), layers(1), prefix_keys=[k0],
                stats=VariantStats(a=0.5, b=0.1, prefix_attention=(0.5,), token_inter_attention=TIA))
        (info,) = c.get_chunk(v1.chunk_key)
        assert list(info.stats.recompute_scores) == []
        again = recompute(c, v1.chunk_key)
        assert again == [1, 3, 5, 2, 0, 4][: len(again)]


def test_recompute_scores_of_the_wrong_length_are_refused(kvserver):
    with KVClient(kvserver.address) as c:
        with pytest.raises(InvalidArgumentError, match="recompute_scores has 2 values for 6 tokens"):
            c.store(MODEL, tokens(2), layers(2), stats=VariantStats(recompute_scores=(1.0, 2.0)))
