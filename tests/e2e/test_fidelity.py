"""Fidelity on live traffic end to end: a RAGAdapter samples its blended requests with shadow
full prefills, off the request's path, and the service tallies what the next Plan carries."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import uuid

import torch

from engine_adapter import LlamaEngine, Policy, ReuseGate
from engine_adapter.fidelity import compare
from engine_adapter.rag import RAGAdapter
from kvclient.client import KVClient
from tests.e2e.test_adapter_service import ENGINE, QUESTION, chunks, in_plan_order, warm


class HeldShadows(LlamaEngine):
    """ENGINE's weights under a name of its own; its full prefills on the sampler's thread
    wait for `release` (the blend itself never calls prefill)."""

    def __init__(self) -> None:
        super().__init__(dataclasses.replace(ENGINE.cfg, name=f"tiny-fidelity-{uuid.uuid4().hex}"), ENGINE.w)
        self.release = threading.Event()
        self.release.set()
        self.waiting = threading.Event()

    def prefill(self, tokens, start_pos=0, *, all_logits=True):  # noqa: ANN001, ANN201
        if threading.current_thread().name.startswith("kvcraft-fidelity"):
            self.waiting.set()
            assert self.release.wait(60)
        return super().prefill(tokens, start_pos, all_logits=all_logits)


def test_sampled_fidelity_reaches_admin_stats_and_counts_what_full_prefill_says(shared_server):
    engine = HeldShadows()
    cs = chunks(11)
    model = engine.model_spec().fingerprint()
    with KVClient(shared_server.address) as client:
        warm(RAGAdapter(engine, client, Policy("full"), gate=ReuseGate()), cs)
        adapter = RAGAdapter(engine, client, Policy("naive"), gate=ReuseGate(), store_back=False,
                             fidelity_sample=1.0)
        agree, kls = 0, []
        orders = list(itertools.permutations(range(4)))[1:24:4]  # 6 orders, none the stored one
        for order in orders:
            result, report = adapter.prefill([cs[i] for i in order], QUESTION, reorder=False)
            assert report.sampled and report.reused_chunks > 0
            served = in_plan_order(cs, report.order, engine)
            full = engine.prefill(torch.tensor([t for c in served for t in c] + QUESTION))[0][-1]
            agree += int(full.argmax()) == int(result.logits.argmax())
            p, q = torch.log_softmax(full.double(), 0), torch.log_softmax(result.logits.double(), 0)
            kls.append(float((p.exp() * (p - q)).sum()))
        adapter.flush()
        cost = adapter.sampling_cost()
        assert cost.sampled == len(orders) and 0 < cost.row_share < 1 and cost.shadow_s > 0
        adapter.prefill(cs, QUESTION)  # its Plan carries the six samples
        adapter.close()
        (got,) = [f for f in client.stats().fidelity if f.model_id == model]
    assert max(kls) > 1e-3  # naive reuse is measurably off: agreement is not 1 by construction
    assert (got.policy, got.samples, got.top1_agree) == ("naive", len(orders), agree)
    assert abs(got.mean_kl - sum(kls) / len(kls)) < 1e-3 * max(1.0, got.mean_kl)
    assert 0 < got.mean_computed_share < 1
    assert got.agree_lower <= agree / len(orders) <= got.agree_upper


def test_the_sampled_request_returns_before_its_shadow_runs(shared_server):
    engine = HeldShadows()
    engine, cs = HeldShadows(), chunks(12)
    with KVClient(shared_server.address) as client:
        warm(RAGAdapter(engine, client, Policy("full"), gate=ReuseGate()), cs)
        adapter = RAGAdapter(engine, client, Policy("naive"), gate=ReuseGate(), store_back=False,
                             fidelity_sample=0.0, fidelity_first=1)
        engine.release.clear()
        result, report = adapter.prefill(cs[::-1], QUESTION)  # returns although its shadow cannot finish
        assert report.sampled and engine.waiting.wait(30)
        assert adapter.sampling_cost().shadow_row_layers == 0 and not adapter.take_timings().fidelity
        _, second = adapter.prefill(cs[1:] + cs[:1], QUESTION)
        assert not second.sampled  # the first request only; the rate is 0
        engine.release.set()
        adapter.flush()
        assert adapter.sampling_cost().shadow_row_layers == report.prompt_tokens * engine.cfg.num_layers
        (sample,) = adapter.take_timings().fidelity
        full = engine.prefill(torch.tensor([t for c in in_plan_order(cs, report.order, engine) for t in c]
                                           + QUESTION))[0][-1]
        assert sample.top1_agree == compare(full, result.logits)[0]
        adapter.close()


def test_samples_the_service_refuses_are_dropped_not_kept_failing_every_plan(shared_server):
    """A Plan refused over the adapter's timings (here a sample out of bounds) is planned again
    without them: the request still reuses, and the next Plan does not carry them."""
    from kvcraft.v1 import kvcraft_pb2 as pb

    engine, cs = HeldShadows(), chunks(12)
    with KVClient(shared_server.address) as client:
        warm(RAGAdapter(engine, client, Policy("full"), gate=ReuseGate()), cs)
        adapter = RAGAdapter(engine, client, Policy("naive"), gate=ReuseGate(), store_back=False,
                             fidelity_sample=0.0, fidelity_first=0)
        adapter._timings.fidelity.append(pb.FidelitySample(policy="naive", kl=-1.0))  # noqa: SLF001 - a sample it refuses
        for _ in range(2):
            _, report = adapter.prefill(cs, QUESTION)
            assert report.plan_error == "" and report.reused_chunks == len(cs), report
        adapter.close()
