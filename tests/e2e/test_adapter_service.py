"""The engine adapter against the real service on loopback: a tiny random-weight Llama
serves RAG requests whose chunk KV was stored by earlier requests in other orders."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
import uuid

import grpc
import pytest
import torch

from engine_adapter import LlamaEngine, Policy, ReuseGate
from engine_adapter.blend import blend_prefill
from engine_adapter.prompt import Segment
from engine_adapter.loader import ServiceLayerSource
from engine_adapter.rag import RAGAdapter
from kvclient.client import KVClient, Ref
from kvclient.errors import from_status
from kvcraft.keys import chunk_key
from kvkernels import RopeConfig

ENGINE = LlamaEngine.random("tiny", seed=0)


@pytest.fixture
def engine(request) -> LlamaEngine:
    """ENGINE's weights under a model name of this test's own: in the shared service its
    chunks, plans and controller are its alone."""
    return LlamaEngine(dataclasses.replace(ENGINE.cfg, name=f"tiny-{request.node.name}-{uuid.uuid4().hex}"), ENGINE.w)


def chunks(seed: int, n: int = 4, length: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(n)]


QUESTION = [7, 11, 13, 17, 19]


def full_logits(engine: LlamaEngine, order: list[list[int]], question: list[int]) -> torch.Tensor:
    tokens = [t for c in order for t in c] + question
    return engine.prefill(torch.tensor(tokens))[0][-1]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def warm(adapter: RAGAdapter, cs: list[list[int]]) -> None:
    """First request: every chunk computed fresh and stored back (each behind the ones before it)."""
    result, report = adapter.prefill(cs, QUESTION)
    adapter.flush()
    assert report.reused_chunks == 0 and report.fresh_chunks == len(cs)


def in_plan_order(cs: list[list[int]], order_keys, engine: LlamaEngine = ENGINE) -> list[list[int]]:
    """The chunks in the order the plan put them."""
    by_key = {chunk_key(engine.model_spec().fingerprint(), c): c for c in cs}
    return [by_key[k] for k in order_keys]


def test_reuse_through_the_service_full_ratio_exact_naive_off_partial_between(shared_server, engine):
    cs = chunks(1)
    with KVClient(shared_server.address) as client:
        warm(RAGAdapter(engine, client, Policy("full"), gate=ReuseGate()), cs)
        shuffled = [cs[2], cs[0], cs[3], cs[1]]
        devs = {}
        for name, ratio in [("cacheblend", 1.0), ("naive", 0.0), ("cacheblend", 0.3), ("cachecraft", 0.0)]:
            policy = Policy(name, ratio=ratio) if name == "cacheblend" else Policy(name)
            adapter = RAGAdapter(engine, client, policy, gate=ReuseGate(), store_back=False)
            result, report = adapter.prefill(shuffled, QUESTION)
            assert report.reused_chunks == 4 and result.reuse
            order = in_plan_order(cs, report.order, engine)
            devs[(name, ratio)] = rel(result.logits, full_logits(engine, order, QUESTION))
    assert devs[("cacheblend", 1.0)] < 1e-4  # 100% recompute == full prefill
    assert devs[("naive", 0.0)] > 0.05  # reusing everything as is is measurably off
    assert devs[("cacheblend", 1.0)] < devs[("cacheblend", 0.3)] < devs[("naive", 0.0)]
    assert devs[("cachecraft", 0.0)] < devs[("naive", 0.0)]


def test_chunk_reused_at_a_new_position_equals_computing_it_there(shared_server, engine):
    """RoPE exactness through the wire: chunk b, stored computed alone (positions 0..19,
    K without RoPE), reused as is at positions 20..39 behind chunk a, has exactly the
    K/V of b computed alone at 20..39 (attention only looks back; b had no prefix)."""
    a, b = chunks(2, n=2)
    with KVClient(shared_server.address) as client:
        warm(RAGAdapter(engine, client, Policy("full"), gate=ReuseGate()), [b])
        src = ServiceLayerSource(client, {1: Ref(chunk_key(engine.model_spec().fingerprint(), b))}, local=False,
                                 deadline=time.monotonic() + 60.0)
        segs = [Segment(tuple(a)), Segment(tuple(b), cached=True), Segment(tuple(QUESTION), question=True)]
        result = blend_prefill(engine, segs, Policy("naive"), src, gate=ReuseGate())
        src.close()
    assert result.reuse and not result.fallbacks
    _, kv_alone = engine.prefill(torch.tensor(b), start_pos=20)
    for layer, (k, v) in enumerate(result.kv):
        assert torch.allclose(k[:, 20:40], kv_alone[layer][0], atol=1e-5)
        assert torch.allclose(v[:, 20:40], kv_alone[layer][1], atol=1e-6)


def test_service_dying_mid_fetch_request_completes_correctly(start_server, caplog):
    server = start_server(env={"KVCRAFT_FAILPOINT": "fetch:after-first-layer"})
    cs = chunks(3)
    with KVClient(server.address) as client:
        warm(RAGAdapter(ENGINE, client, Policy("full"), gate=ReuseGate()), cs)
        adapter = RAGAdapter(ENGINE, client, Policy("cacheblend", ratio=0.3, layer_budget_s=5.0),
                             gate=ReuseGate(), store_back=False)
        with caplog.at_level(logging.WARNING):
            result, report = adapter.prefill(cs[::-1], QUESTION)
    assert server.proc.wait(timeout=30) == 137  # the service died after layer 0
    order = in_plan_order(cs, report.order)
    assert rel(result.logits, full_logits(ENGINE, order, QUESTION)) < 1e-4
    # Every reused chunk was computed from the layer the stream broke at (0 or 1: whether
    # layer 0 left the dying process's socket is up to the kernel).
    assert {c for c, _ in report.fallbacks} == {0, 1, 2, 3}
    assert {layer for _, layer in report.fallbacks} <= {0, 1}
    assert "kvcraft fetch stopped" in caplog.text


def test_stalled_service_past_the_deadline_is_computed_instead(kvserver, caplog):
    cs = chunks(4)
    with KVClient(kvserver.address, timeout=2.0) as client:
        warm(RAGAdapter(ENGINE, client, Policy("full"), gate=ReuseGate()), cs)
        plan = client.plan(ENGINE.model_spec().fingerprint(), cs, len(QUESTION))
        refs = {i: Ref(cp.chunk_key, cp.variant_id) for i, cp in enumerate(plan.chunks)}
        os.kill(kvserver.proc.pid, signal.SIGSTOP)  # the service hangs: no layer arrives
        try:
            src = ServiceLayerSource(client, refs, local=False, deadline=time.monotonic() + 2.0)
            segs = [Segment(tuple(c), cached=True) for c in in_plan_order(cs, plan.order)] + [
                Segment(tuple(QUESTION), question=True)]
            with caplog.at_level(logging.WARNING):
                result = blend_prefill(ENGINE, segs, Policy("naive", layer_budget_s=0.05), src, gate=ReuseGate())
            src.close()
        finally:
            os.kill(kvserver.proc.pid, signal.SIGCONT)
    order = in_plan_order(cs, plan.order)
    assert rel(result.logits, full_logits(ENGINE, order, QUESTION)) < 1e-4
    assert len(result.fallbacks) == 4


def test_failing_reuse_probe_refuses_reuse_and_answers_match_full_prefill(shared_server, engine, caplog):
    cs = chunks(5)
    bad = LlamaEngine(engine.cfg, engine.w, rope=RopeConfig(head_dim=16, theta=1e5))  # forward disagrees with its spec
    with KVClient(shared_server.address) as client:
        warm(RAGAdapter(engine, client, Policy("full"), gate=ReuseGate()), cs)
        adapter = RAGAdapter(bad, client, Policy("cacheblend", ratio=0.3), gate=ReuseGate(), store_back=False)
        with caplog.at_level(logging.ERROR):
            result, report = adapter.prefill(cs[::-1], QUESTION)
    assert not result.reuse
    assert "reuse probe FAILED" in caplog.text
    order = in_plan_order(cs, report.order, engine)
    assert torch.allclose(result.logits, bad.prefill(torch.tensor([t for c in order for t in c] + QUESTION))[0][-1])


def test_same_host_fast_path_gives_the_streamed_result(kvserver):
    cs = chunks(6)
    with KVClient(kvserver.address) as client:
        warm(RAGAdapter(ENGINE, client, Policy("full"), gate=ReuseGate()), cs)
        out = {}
        for local in (False, True):
            adapter = RAGAdapter(ENGINE, client, Policy("cacheblend", ratio=0.3), gate=ReuseGate(),
                                 store_back=False, local=local)
            out[local], report = adapter.prefill(cs[::-1], QUESTION)
            assert report.reused_chunks == 4 and not report.fallbacks
        assert client.stats().leases == 0  # both the plan's and Locate's leases released
    assert torch.equal(out[True].logits, out[False].logits)


def test_a_service_that_refuses_locate_for_another_host_turns_local_off_and_says_so_once(shared_server, engine,
                                                                                          caplog):
    """Locate answered FAILED_PRECONDITION (the service does not see this client on its
    host; on loopback it never does, so the refusal is raised as the client raises the
    service's): the adapter streams, turns `local` off, and one warning says why."""
    cs = chunks(8)
    with KVClient(shared_server.address) as client:
        warm(RAGAdapter(engine, client, Policy("full"), gate=ReuseGate()), cs)
        asked = []

        def refused(*args, **kwargs):  # noqa: ANN002, ANN003
            asked.append(args)
            raise from_status(grpc.StatusCode.FAILED_PRECONDITION.value[0],
                              "the client at 10.1.0.12 is not on this service's host: shared memory is not "
                              "reachable from there; stream the layers (FetchLayers)")

        client.fetch_local = refused
        adapter = RAGAdapter(engine, client, Policy("cacheblend", ratio=0.3), gate=ReuseGate(),
                             store_back=False, local=True)
        with caplog.at_level(logging.WARNING):
            for _ in range(2):
                _, report = adapter.prefill(cs[::-1], QUESTION)
                assert report.reused_chunks == 4 and not report.fallbacks  # every chunk streamed
    assert not adapter.local and len(asked) == 1  # Locate asked once, never again
    said = [r.getMessage() for r in caplog.records if r.name.startswith("engine_adapter")]
    assert len(said) == 1 and "not on this host" in said[0] and "10.1.0.12" in said[0], said


@pytest.mark.parametrize("host_budget,tier", [(1, "disk"), (64 << 20, "host")])
def test_load_timings_name_the_tier_the_plan_read_from(start_server, host_budget, tier):
    """The loading controller learns T_load per tier: a stream of variants that lie on
    disk is reported as disk, not as host."""
    server = start_server(host_budget_bytes=host_budget)
    cs = chunks(5)
    with KVClient(server.address) as client:
        warm(RAGAdapter(ENGINE, client, Policy("full"), gate=ReuseGate()), cs)
        adapter = RAGAdapter(ENGINE, client, Policy("naive"), gate=ReuseGate(), store_back=False)
        adapter.prefill([cs[1], cs[0], cs[3], cs[2]], QUESTION)
        loads = list(adapter._timings.loads)
        assert loads and {t.tier for t in loads} == {tier}


def test_same_host_reads_report_their_load_timings(start_server):
    """local=True: the layers the engine read from the service's shared memory are reported
    to the loading controller, one report per layer, under the tier the slab is, with the
    bytes of K and V of the reused chunks; the next Plan carries them to the service."""
    server = start_server(host_budget_bytes=64 << 20)
    cs = chunks(8)
    with KVClient(server.address) as client:
        warm(RAGAdapter(ENGINE, client, Policy("full"), gate=ReuseGate()), cs)
        adapter = RAGAdapter(ENGINE, client, Policy("naive"), gate=ReuseGate(), store_back=False, local=True)
        _, report = adapter.prefill(cs[::-1], QUESTION)
        assert report.reused_chunks == len(cs)
        loads = list(adapter._timings.loads)
        spec = ENGINE.model_spec()
        itemsize = torch.empty((), dtype=ENGINE.dtype).element_size()
        per_layer = sum(len(c) for c in cs) * spec.num_kv_heads * spec.head_dim * itemsize * 2  # K and V
        assert [t.tier for t in loads] == ["host"] * spec.num_layers
        assert [t.bytes_per_layer for t in loads] == [per_layer] * spec.num_layers
        assert all(0 < t.seconds < 1.0 for t in loads)
        _, report = adapter.prefill(cs, QUESTION)  # its Plan carries them: the service takes them
        assert report.plan_error == "" and report.reused_chunks == len(cs)
        assert not adapter._timings.computes or len(adapter._timings.loads) == spec.num_layers
        assert client.stats().leases == 0


def test_the_report_counts_the_chunks_whose_stored_kv_was_used_not_the_ones_offered(shared_server, engine):
    """Every chunk is stored and the plan offers all four; policy full computes every
    token, so none is reused; naive reuses all four."""
    cs = chunks(5)
    with KVClient(shared_server.address) as client:
        warm(RAGAdapter(engine, client, Policy("full"), gate=ReuseGate()), cs)
        reused = {}
        for name in ("full", "naive"):
            adapter = RAGAdapter(engine, client, Policy(name), gate=ReuseGate(), store_back=False)
            plan = client.plan(adapter.model_id, cs, len(QUESTION), first_turn=False)
            offered = sum(1 for cp in plan.chunks if cp.variant_id)
            result, report = adapter.serve(plan, cs, QUESTION)
            assert offered == 4 and report.fresh_chunks == 0
            reused[name] = report.reused_chunks
            assert report.reused_chunks == len(result.reused_segments)
    assert reused == {"full": 0, "naive": 4}
