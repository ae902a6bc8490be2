"""Learned recompute lists from the engine side: a request that computes a
chunk in full while a variant of it is stored sends, on store-back, the new variant's
`recompute_scores` = this request's learned scores against that stored variant
(`learned.learn`: greedy recompute gain from the top `fresh_gain` token).
Real server on loopback, tiny random-weight Llama; the reference recomputes the gains
from the engine's own full prefill and the stored variant fetched back."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
import torch

from engine_adapter import LlamaEngine, Policy, ReuseGate
from engine_adapter import learned
from engine_adapter.rag import RAGAdapter
from kvclient.client import KVClient
from kvcraft.keys import chunk_key

ENGINE = LlamaEngine.random("tiny", seed=4)
QUESTION = [7, 11, 13, 17]


@pytest.fixture
def engine(request) -> LlamaEngine:
    """ENGINE's weights under a model name of this test's own: in the shared service its
    chunks and their variants are its alone."""
    return LlamaEngine(dataclasses.replace(ENGINE.cfg, name=f"tiny-{request.node.name}-{uuid.uuid4().hex}"), ENGINE.w)


def chunks(seed: int, n: int = 3, length: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(n)]


def test_store_back_sends_the_learned_scores_against_the_stored_variant(shared_server, engine):
    cs = chunks(5)
    fp = engine.model_spec().fingerprint()
    keys = [chunk_key(fp, c) for c in cs]
    with KVClient(shared_server.address) as client:
        first = RAGAdapter(engine, client, Policy("full"), gate=ReuseGate(), learn=True)
        first.prefill(cs, QUESTION, reorder=False)
        first.close()
        for k in keys:  # the first computation of a chunk has nothing to compare with
            (info,) = client.get_chunk(k)
            assert list(info.stats.recompute_scores) == []
        stored = {k: client.fetch(k) for k in keys}

        order = [cs[1], cs[0], cs[2]]  # every chunk behind a new prefix
        second = RAGAdapter(engine, client, Policy("full"), gate=ReuseGate(), learn=True)
        second.prefill(order, QUESTION, reorder=False)
        second.close()

        tokens = [t for c in order for t in c]
        _, kv = engine.prefill(torch.tensor(tokens + QUESTION))
        context = [(k[:, :len(tokens)], v[:, :len(tokens)]) for k, v in kv]
        ok = 0
        for i, c in enumerate(order):
            key = chunk_key(fp, c)
            prefix = [chunk_key(fp, d) for d in order[:i]]
            (new,) = [v for v in client.get_chunk(key) if list(v.prefix_keys) == prefix]
            span = (sum(map(len, order[:i])), sum(map(len, order[:i + 1])))
            want = learned.learn(engine, [learned.GainCase(context, span, tuple(QUESTION), stored[key], tuple(c))])[0]
            got = torch.tensor(list(new.stats.recompute_scores))
            assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-3, atol=1e-6), (i, got, want)
            ok += int(float(want.max()) > 0)
        assert ok  # some token's stale KV did cost this answer something: the check is not vacuous


def test_store_back_without_learning_sends_no_scores(shared_server, engine):
    cs = chunks(6)
    fp = engine.model_spec().fingerprint()
    with KVClient(shared_server.address) as client:
        for order in (cs, [cs[2], cs[1], cs[0]]):
            a = RAGAdapter(engine, client, Policy("full"), gate=ReuseGate(), learn=False)
            a.prefill(order, QUESTION, reorder=False)
            a.close()
        for c in cs:
            infos = client.get_chunk(chunk_key(fp, c))
            assert len(infos) == 2 and all(list(v.stats.recompute_scores) == [] for v in infos)


def test_a_failure_while_learning_stores_the_chunk_without_scores(shared_server, engine, monkeypatch, caplog):
    def broken(*a, **k):
        raise RuntimeError("gain exploded")

    cs = chunks(7)
    fp = engine.model_spec().fingerprint()
    with KVClient(shared_server.address) as client:
        first = RAGAdapter(engine, client, Policy("full"), gate=ReuseGate(), learn=True)
        first.prefill(cs, QUESTION, reorder=False)
        first.close()
        monkeypatch.setattr(learned, "learn", broken)
        second = RAGAdapter(engine, client, Policy("full"), gate=ReuseGate(), learn=True)
        second.prefill(cs[::-1], QUESTION, reorder=False)
        second.close()
        for c in cs:
            infos = client.get_chunk(chunk_key(fp, c))
            assert len(infos) == 2 and all(list(v.stats.recompute_scores) == [] for v in infos)
    assert "gain exploded" in caplog.text
