"""Gray failures across hosts: a node or the master frozen (SIGSTOP: alive, its sockets
open, answering nothing), then resumed (SIGCONT), while the engines on the other hosts
keep serving (docs/scale-out.md, "When something dies or freezes").

A cluster of this module's own (tests/cluster/conftest.py builds it), the tests in this
order, each on prompts no earlier test computed. Every engine answer is checked against
the same engine's full prefill; after each fault, every listed entry is read as a node
reads it: its payload must be the bytes the entry describes.
"""

from __future__ import annotations

import pytest
import torch

from kvclient.client import KVClient
from kvcraft.keys import ModelSpec, chunk_key
from tests.cluster.conftest import running_cluster, wait_for
from tests.cluster.helpers import listed, misdescribed

pytestmark = pytest.mark.slow

SPEC = ModelSpec("frozen-test", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16")
MODEL = SPEC.fingerprint()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from running_cluster(tmp_path_factory, "frozen")


def layers_of(seed: int, tokens: int = 24) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, tokens, 16, generator=g).bfloat16(), torch.randn(2, tokens, 16, generator=g).bfloat16())
            for _ in range(SPEC.num_layers)]


def same_bytes(got, want) -> bool:
    return len(got) == len(want) and all(
        torch.equal(gk.view(torch.int16), wk.view(torch.int16)) and torch.equal(gv.view(torch.int16), wv.view(torch.int16))
        for (gk, gv), (wk, wv) in zip(got, want))


def test_two_nodes_storing_one_variant_id_with_other_bytes_list_the_bytes_they_point_to(cluster):
    """A and C store one chunk (one variant id: same tokens, no prefix) with different KV
    bytes, as two engines whose kernels round differently would: the listing names a
    payload that is exactly the bytes it describes, and node B reads those bytes."""
    tokens, marker = list(range(100, 124)), list(range(200, 224))
    by_a, by_c = layers_of(1), layers_of(2)
    key = chunk_key(MODEL, tokens)
    with KVClient(cluster.address("a")) as ca, KVClient(cluster.address("c")) as cc, \
            KVClient(cluster.address("b")) as cb:
        first = ca.store(MODEL, tokens, by_a)
        wait_for("A's copy listed", lambda: first.variant_id in listed(cluster, [key]), 10)
        assert cc.store(MODEL, tokens, by_c).variant_id == first.variant_id
        # C's write-throughs run one at a time, in order: once the next one is listed, the
        # copy-out of the first is over.
        later = cc.store(MODEL, marker, layers_of(3, len(marker)))
        wait_for("C's later variant listed", lambda: later.variant_id in listed(cluster, [later.chunk_key]), 10)
        assert misdescribed(cluster, [key]) == []
        plan = cb.plan(MODEL, [tokens], question_tokens=8)
        assert plan.chunks[0].variant_id == first.variant_id and plan.chunks[0].tier == "remote", plan
        got = cb.fetch(key, first.variant_id)
        cb.release(plan.lease_id)
    assert same_bytes(got, by_a) or same_bytes(got, by_c)
