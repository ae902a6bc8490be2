"""Fidelity on live traffic end to end: a RAGAdapter measures the blended requests its Plans
mark with shadow full prefills, off the request's path; the service tallies what the next Plan
carries, and an adaptive adapter's budget follows them (to exact reuse only where reuse with a
budget fails, to full prefill where exact reuse fails too)."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import uuid

import pytest
import torch

from engine_adapter import LlamaEngine, Policy, ReuseGate
from engine_adapter.cost import BLEND_LIMIT, planned_share
from engine_adapter.fidelity import compare
from engine_adapter.near_tie import lead
from engine_adapter.policy import DEFAULT_POLICY, parse_policy, with_budget
from engine_adapter.probe import TRUSTED
from engine_adapter.rag import RAGAdapter
from kvclient.client import KVClient
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.fidelity import COLD_START, LADDER, LEAD_EDGES, MIN_VERDICT_SAMPLES
from tests.e2e.test_adapter_service import ENGINE, QUESTION, chunks, full_logits, in_plan_order, warm


class HeldShadows(LlamaEngine):
    """ENGINE's weights under a name of its own (`logit_scale`: its logits that many times
    larger, as a sharper model's); its full prefills on the sampler's thread wait for `release`
    at their first call (the embedding)."""

    def __init__(self, logit_scale: float = 1.0) -> None:
        w = {**ENGINE.w, "model.norm.weight": ENGINE.w["model.norm.weight"] * logit_scale}
        super().__init__(dataclasses.replace(ENGINE.cfg, name=f"tiny-fidelity-{uuid.uuid4().hex}"), w)
        self.release = threading.Event()
        self.release.set()
        self.waiting = threading.Event()

    def embed(self, tokens):  # noqa: ANN001, ANN201
        if threading.current_thread().name.startswith("kvcraft-fidelity"):
            self.waiting.set()
            assert self.release.wait(60)
        return super().embed(tokens)


def test_sampled_fidelity_reaches_admin_stats_and_counts_what_full_prefill_says(shared_server):
    engine = HeldShadows()
    cs = chunks(11)
    model = engine.model_spec().fingerprint()
    with KVClient(shared_server.address) as client:
        warm(RAGAdapter(engine, client, Policy("full"), gate=ReuseGate()), cs)
        adapter = RAGAdapter(engine, client, Policy("naive"), gate=ReuseGate(), store_back=False)
        agree, kls, answer = 0, [], [0, 0]  # a new model: its first 8 requests are measured
        orders = list(itertools.permutations(range(4)))[1:24:4]  # 6 orders, none the stored one
        for order in orders:
            gen, result, report = adapter.generate([cs[i] for i in order], QUESTION, 6, reorder=False)
            assert report.sampled and report.reused_chunks > 0
            served = [t for c in in_plan_order(cs, report.order, engine) for t in c] + QUESTION
            full = engine.prefill(torch.tensor(served))[0][-1]
            agree += int(full.argmax()) == int(result.logits.argmax())
            for i in range(1, len(gen.tokens)):  # teacher forcing: full prefill fed the served answer
                answer[0] += 1
                answer[1] += int(engine.prefill(torch.tensor(served + list(gen.tokens[:i])))[0][-1].argmax()) \
                    == gen.tokens[i]
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
    assert (got.answer_tokens, got.answer_agree) == tuple(answer) and answer[0] == 5 * len(orders)
    assert abs(got.mean_kl - sum(kls) / len(kls)) < 1e-3 * max(1.0, got.mean_kl)
    assert 0 < got.mean_computed_share < 1
    assert got.agree_lower <= agree / len(orders) <= got.agree_upper


def test_the_sampled_request_returns_before_its_shadow_runs(shared_server):
    engine = HeldShadows()
    engine, cs = HeldShadows(), chunks(12)
    with KVClient(shared_server.address) as client:
        warm(RAGAdapter(engine, client, Policy("full"), gate=ReuseGate()), cs)
        adapter = RAGAdapter(engine, client, Policy("naive"), gate=ReuseGate(), store_back=False)
        engine.release.clear()
        result, report = adapter.prefill(cs[::-1], QUESTION)  # returns although its shadow cannot finish
        assert report.sampled and engine.waiting.wait(30)
        assert adapter.sampling_cost().shadow_row_layers == 0 and not adapter.take_timings().fidelity
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
        adapter = RAGAdapter(engine, client, Policy("naive"), gate=ReuseGate(), store_back=False, shadows=False)
        adapter._timings.fidelity.append(pb.FidelitySample(policy="naive", kl=-1.0))  # noqa: SLF001 - a sample it refuses
        for _ in range(2):
            _, report = adapter.prefill(cs, QUESTION)
            assert report.plan_error == "" and report.reused_chunks == len(cs), report
        adapter.close()


def test_an_adaptive_adapter_measures_the_least_budget_by_a_shadow_blend_the_service_counts(shared_server):
    """A new model starts at COLD_START, and its Plans name the least budget: the shadow
    blends the request at that budget from the KV it was served from. The sample the service
    tallies under that budget is what an adapter serving that budget itself (its own Plan and
    fetch) gives against full prefill."""
    engine, cs = HeldShadows(), chunks(14)
    model = engine.model_spec().fingerprint()
    with KVClient(shared_server.address) as client:
        warm(RAGAdapter(engine, client, Policy("full"), gate=ReuseGate()), cs)
        adapter = RAGAdapter(engine, client, gate=TRUSTED, store_back=False)
        prompt = cs[::-1]
        _, report = adapter.prefill(prompt, QUESTION, reorder=False)
        adapter.flush()
        assert report.sampled and report.budget == COLD_START and report.reused_chunks == len(cs)
        assert adapter.sampling_cost().shadow_blends == 1
        adapter.prefill(prompt, QUESTION, reorder=False)  # its Plan carries both samples
        adapter.close()
        least = LADDER[0]
        alone = RAGAdapter(engine, client, Policy("query", budget=least), gate=TRUSTED, store_back=False, shadows=False)
        served, report = alone.prefill(prompt, QUESTION, reorder=False)
        alone.close()
        tallies = {round(f.budget, 4): f for f in client.stats().fidelity if f.model_id == model}
    full = engine.prefill(torch.tensor([t for c in in_plan_order(cs, report.order, engine) for t in c]
                                       + QUESTION))[0][-1]
    agree, kl = compare(full, served.logits)
    assert kl > 1e-4  # the least budget is off: the comparison is not trivially exact
    blended = tallies[least]
    assert (blended.samples, blended.shadow_blends, blended.top1_agree) == (1, 1, int(agree))
    assert blended.mean_kl == pytest.approx(kl, rel=1e-3)
    assert (tallies[COLD_START].samples, tallies[COLD_START].shadow_blends) == (1, 0)


# Plans an adaptive adapter may take, when reuse gives wrong answers, before its model is
# served by exact reuse only (budget 1): three budgets (COLD_START and the two above) shown
# short, each after MIN_VERDICT_SAMPLES samples when they all disagree (31 Plans here), more
# when some agree; then, when exact reuse disagrees too, its own MIN_VERDICT_SAMPLES (a sample
# goes with the Plan after its request's) before no stored KV is served.
PLANS_TO_FULL = 60
PLANS_TO_NO_REUSE = MIN_VERDICT_SAMPLES + 3


def test_at_budget_1_an_adaptive_adapter_reuses_the_exact_prefix_and_computes_the_rest(shared_server):
    """Budget 1 (no budget below holds the target) is exact reuse, as a prefix cache: the
    leading chunks stored behind exactly the chunks before them come from storage, the rest
    is computed; the logits are full prefill's. `no_reuse` (exact reuse shown wrong) computes
    every row."""
    engine, cs = HeldShadows(), chunks(15, n=4)
    layers, n = engine.cfg.num_layers, sum(map(len, cs)) + len(QUESTION)
    with KVClient(shared_server.address) as client:
        first = RAGAdapter(engine, client, Policy("full"), gate=ReuseGate())
        first.prefill(cs[:3], QUESTION, reorder=False)  # stored: a, b behind a, c behind a b
        first.close()
        prompt = [cs[0], cs[1], cs[3], cs[2]]  # a b stored exactly, d new, c behind another prefix
        full = engine.prefill(torch.tensor([t for c in prompt for t in c] + QUESTION))[0][-1]
        adapter = RAGAdapter(engine, client, gate=TRUSTED, store_back=False, shadows=False)
        for no_reuse, reused, served in [(False, 2, "query"), (True, 0, "full")]:
            plan = client.plan(adapter.model_id, prompt, len(QUESTION), first_turn=False, policy="query",
                               adaptive=True)
            assert sum(1 for c in plan.chunks if c.reused) == 3  # a, b and c offered; a b exact
            plan = dataclasses.replace(plan, recompute_budget=1.0, no_reuse=no_reuse)
            result, report = adapter.serve(plan, prompt, QUESTION)
            assert (report.budget, report.reused_chunks, report.policy) == (1.0, reused, served)
            assert report.computed_rows == (n - reused * len(cs[0])) * layers
            assert torch.allclose(result.logits, full, atol=1e-4, rtol=0)
        adapter.close()


def test_an_adaptive_request_with_too_few_chunks_stored_to_blend_is_served_by_exact_reuse(shared_server):
    """The cost gate (`engine_adapter.cost`): a request whose blend would compute BLEND_LIMIT or
    more of the rows exact reuse computes is served by exact reuse unless its Plan asks to measure
    it: that prefix from storage, every other row computed, full prefill's logits; its fresh
    chunks are stored back, so the same prompt next is exact reuse of every chunk. The same chunks
    in another order, all stored behind other prefixes, are blended at the Plan's budget. A near-tie
    margin above any lead serves that blend again by full prefill, never exact reuse (full
    prefill's already)."""
    engine, cs = HeldShadows(), chunks(16, n=5)
    layers, q = engine.cfg.num_layers, len(QUESTION)
    with KVClient(shared_server.address) as client:
        first = RAGAdapter(engine, client, Policy("full"), gate=ReuseGate())
        first.prefill(cs[:2], QUESTION, reorder=False)  # stored: a alone, b behind a
        first.close()
        prompt = [cs[0], cs[2], cs[1], cs[3], cs[4]]  # a exact; b stored behind another prefix; c, d, e new
        n = sum(map(len, prompt)) + q
        measured = RAGAdapter(engine, client, gate=TRUSTED, store_back=False)  # the cold start measures all
        _, report = measured.prefill(prompt, QUESTION, reorder=False)
        measured.close()
        assert report.sampled and not report.blend_skipped and report.reused_chunks == 2
        adapter = RAGAdapter(engine, client, gate=TRUSTED, near_tie=1e9, shadows=False)
        # 5 chunks of 20 tokens and a question of 5: the blend computes 105 - 0.75 x 40 rows, exact reuse 85
        assert planned_share(n, [len(cs[0]), len(cs[1])], len(cs[0]), COLD_START) == 75 / 85 >= BLEND_LIMIT
        for reused in (1, 5):  # then every chunk, stored back by the first, behind exactly the ones before it
            result, report = adapter.prefill(prompt, QUESTION, reorder=False)
            adapter.flush()
            assert report.blend_skipped and report.budget == COLD_START and not report.near_tie
            assert (report.reused_chunks, report.policy) == (reused, "query")
            assert report.computed_rows == (n - sum(map(len, prompt[:reused]))) * layers
            assert torch.allclose(result.logits, full_logits(engine, prompt, QUESTION), atol=1e-4, rtol=0)
        result, report = adapter.prefill(prompt[::-1], QUESTION, reorder=False)
        adapter.close()
    assert not report.blend_skipped and report.near_tie and report.budget == COLD_START


def test_an_adaptive_adapter_on_broken_kv_ends_at_full_prefill_with_full_prefills_answers(shared_server):
    """Every stored chunk's KV replaced by noise (as a broken rotation or a corrupted writer
    would store it) and no reuse probe: the default policy's answers disagree with full
    prefill's, the samples say so, and within PLANS_TO_FULL requests the service's budget is 1:
    the adapter serves full prefill, whose logits equal the engine's own."""
    engine, cs = HeldShadows(), chunks(13, n=6)
    model = engine.model_spec().fingerprint()
    g = torch.Generator().manual_seed(5)
    with KVClient(shared_server.address) as client:
        for i, c in enumerate(cs):  # stored alone, so that every order reuses them
            kv = engine.prefill(torch.tensor(c))[1]
            client.store(model, c, [(torch.randn(k.shape, generator=g) * 4, torch.randn(v.shape, generator=g) * 4)
                                    for k, v in kv])
        adapter = RAGAdapter(engine, client, gate=TRUSTED, store_back=False)
        orders = itertools.cycle(itertools.permutations(range(len(cs)), 4))
        budgets, exact, sampled = [], [], 0
        for _ in range(PLANS_TO_FULL + PLANS_TO_NO_REUSE):
            order = next(orders)
            result, report = adapter.prefill([cs[i] for i in order], QUESTION, reorder=False)
            adapter.flush()  # its sample goes with the next Plan
            budgets.append(report.budget)
            sampled += report.sampled
            if report.budget == 1.0:
                exact.append(report.reused_chunks)
                if not report.reused_chunks:
                    break
        assert budgets[0] == COLD_START and budgets[-1] == 1.0, budgets
        assert sorted(set(budgets)) == budgets[:1] + sorted(set(budgets) - {budgets[0]})  # only ever up
        # Budget 1: the leading chunk (stored alone) reused exactly, shown wrong, then nothing.
        assert len(exact) <= PLANS_TO_NO_REUSE and set(exact[:-1]) == {1} and exact[-1] == 0, exact
        for order in [(5, 4, 3, 2), (0, 2, 4, 1)]:
            prompt = [cs[i] for i in order]
            result, report = adapter.prefill(prompt, QUESTION, reorder=False)
            assert report.budget == 1.0 and report.reused_chunks == 0 and not report.sampled
            full = engine.prefill(torch.tensor([t for c in prompt for t in c] + QUESTION))[0][-1]
            assert torch.allclose(result.logits, full, atol=1e-5, rtol=0)
        adapter.close()
        (choice,) = [b for b in client.stats().budgets if b.model_id == model]
    assert (choice.policy, choice.budget, choice.state) == ("query", 1.0, "full")
    assert sampled >= 3 + MIN_VERDICT_SAMPLES  # the budgets, and exact reuse, were left on evidence


def test_a_blend_whose_first_token_is_a_near_tie_is_served_by_full_prefill(shared_server):
    """`near_tie`: the requests whose blended first token leads the runner-up by less than the
    margin are served exactly (full prefill of the order served, nothing reused), the others as
    without the gate; the margin is read off the ungated blends, the full prefills computed here."""
    engine, cs = HeldShadows(), chunks(13)
    orders = list(itertools.permutations(range(4)))[1:24:3]
    with KVClient(shared_server.address) as client:
        warm(RAGAdapter(engine, client, Policy("full"), gate=ReuseGate()), cs)
        ungated = RAGAdapter(engine, client, Policy("naive"), gate=TRUSTED, store_back=False, shadows=False)
        blends = [ungated.prefill([cs[i] for i in o], QUESTION, reorder=False) for o in orders]
        leads = sorted(float(v[0] - v[1]) for v in (r.logits.topk(2).values for r, _ in blends))
        margin = (leads[len(leads) // 2 - 1] + leads[len(leads) // 2]) / 2  # half the requests under it
        gated = RAGAdapter(engine, client, Policy("naive"), gate=TRUSTED, store_back=False, shadows=False,
                           near_tie=margin)
        for order, (blend, before) in zip(orders, blends):
            result, report = gated.prefill([cs[i] for i in order], QUESTION, reorder=False)
            top = blend.logits.topk(2).values
            if float(top[0] - top[1]) < margin:
                served = [t for c in in_plan_order(cs, report.order, engine) for t in c] + QUESTION
                torch.testing.assert_close(result.logits, engine.prefill(torch.tensor(served))[0][-1])
                computed = before.computed_rows + len(served) * engine.cfg.num_layers  # the blend's, then every row
                assert (report.reused_chunks, report.computed_rows, report.near_tie) == (0, computed, True)
            else:
                torch.testing.assert_close(result.logits, blend.logits)
                assert report.computed_rows == before.computed_rows and report.reused_chunks > 0
                assert not report.near_tie
        ungated.close()
        gated.close()
    assert leads[0] < margin < leads[-1]


def test_an_adaptive_adapter_serves_near_ties_under_the_margin_its_plans_give_and_samples_their_blends(
        shared_server):
    """The service learns the near-tie margin from the samples' leads (`kvservice.fidelity`:
    the edge above the largest lead lost): one loss just under an edge among many kept. An
    adaptive adapter then serves a blend that leads by less by full prefill, the others as
    blended, and a near tie's sample is its blend's, against the full prefill it was served by
    (the budget is judged on the blends as they are)."""
    engine, cs = HeldShadows(logit_scale=30.0), chunks(13)  # leads of tenths of a logit to a few
    model = engine.model_spec().fingerprint()
    orders = list(itertools.permutations(range(4)))[1:24:3]
    with KVClient(shared_server.address) as client:
        warm(RAGAdapter(engine, client, Policy("full"), gate=ReuseGate()), cs)
        cold = with_budget(parse_policy(DEFAULT_POLICY), COLD_START)  # the adaptive adapter's first Plans' policy
        ungated = RAGAdapter(engine, client, cold, gate=TRUSTED, store_back=False, shadows=False, near_tie=0.0)
        blends = [ungated.prefill([cs[i] for i in o], QUESTION, reorder=False)[0] for o in orders]
        ungated.close()
        leads = sorted(lead(b.logits) for b in blends)
        split = [e for e in LEAD_EDGES if leads[0] < e < leads[-1]]
        assert split, leads  # an edge with some requests' leads under it and some over
        margin = split[0]
        under = max((e for e in LEAD_EDGES if e < margin), default=0.0)
        lost = pb.FidelitySample(policy="query", top1_agree=False, kl=1.0, computed_share=0.3, budget=COLD_START,
                                 lead=under)
        kept = pb.FidelitySample(policy="query", top1_agree=True, kl=0.1, computed_share=0.3, budget=COLD_START,
                                 lead=2 * LEAD_EDGES[-1])
        for samples in ([lost] + [kept] * 49, [kept] * 50):  # at most 64 a Plan
            plan = client.plan(model, cs, len(QUESTION), timings=pb.TimingReport(fidelity=samples), policy="query",
                               adaptive=True)
        assert plan.near_tie == pytest.approx(margin) and plan.recompute_budget == COLD_START
        adapter = RAGAdapter(engine, client, gate=TRUSTED, store_back=False)
        agree, gated = 0, []
        for order, blend in zip(orders, blends):
            prompt = [cs[i] for i in order]
            result, report = adapter.prefill(prompt, QUESTION, reorder=False)
            adapter.flush()
            full = full_logits(engine, in_plan_order(cs, report.order, engine), QUESTION)
            assert report.sampled and report.budget == COLD_START
            assert report.near_tie == (lead(blend.logits) < margin)
            torch.testing.assert_close(result.logits, full if report.near_tie else blend.logits)
            agree += int(blend.logits.argmax()) == int(full.argmax())
            gated.append(report.near_tie)
            # its samples (and its shadow blend's) now, so that the margin the next Plan gives is known here
            margin = client.plan(model, cs, len(QUESTION), timings=adapter.take_timings(), policy="query",
                                 adaptive=True).near_tie
        cost = adapter.sampling_cost()
        adapter.close()
        (tally,) = [t for t in client.stats().fidelity if t.model_id == model and t.budget == pytest.approx(COLD_START)]
    assert (tally.samples, tally.top1_agree) == (100 + len(orders), 99 + agree)
    assert (cost.served, cost.blended, cost.sampled) == (len(orders), gated.count(False), len(orders))
    assert any(gated) and not all(gated), gated
