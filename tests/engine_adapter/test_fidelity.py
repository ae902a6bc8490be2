"""Sampled shadow prefills (engine_adapter.fidelity): the comparison, which requests are
sampled, and the shadow blend at a budget below."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from engine_adapter.blend import blend_prefill
from engine_adapter.result import BlendResult
from engine_adapter.fidelity import ANSWER_TOKENS, ShadowBlend, ShadowSampler, compare
from engine_adapter.generate import greedy
from engine_adapter.policy import Policy
from engine_adapter.probe import TRUSTED
from engine_adapter.source import InMemoryLayerSource, RecordingLayerSource
from tests.engine_adapter.adapter_helpers import make_prompt


def test_compare_gives_top1_agreement_and_kl_of_full_from_served():
    full = torch.tensor([2.0, 1.0, 0.0])
    served = torch.tensor([0.5, 1.5, 0.0])
    p, q = torch.softmax(full.double(), 0), torch.softmax(served.double(), 0)
    agree, kl = compare(full, served)
    assert not agree and kl == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-12)
    assert compare(full, full.clone()) == (True, 0.0)


def _result(engine, tokens: int, reused: bool) -> BlendResult:  # noqa: ANN001
    L = engine.cfg.num_layers
    return BlendResult(logits=torch.zeros(engine.cfg.vocab_size), kv=[], reuse=reused, prompt_tokens=tokens,
                       computed_rows=[tokens // 4] * L, reused_segments=[0] if reused else [])


def test_blended_requests_whose_plan_asks_are_sampled_with_their_budget(engine):
    sampler = ShadowSampler(engine)
    spans = [(1, 2, 3, 4), (5, 6)]
    asked = [(False, True), (True, True), (True, False), (True, True)]  # (blended, the plan asks)
    got = [sampler.observe(spans, _result(engine, 6, reused), "query", 0.25, ask) for reused, ask in asked]
    sampler.wait()
    assert got == [False, True, False, True]  # a request served without stored KV is not blended
    cost = sampler.cost()
    assert (cost.served, cost.blended, cost.sampled) == (4, 3, 2)
    assert cost.shadow_row_layers == 2 * 6 * engine.cfg.num_layers
    assert cost.served_row_layers == 4 * 1 * engine.cfg.num_layers
    assert cost.row_share == pytest.approx(12 / 16)
    samples = sampler.take()
    assert [(s.policy, s.budget) for s in samples] == [("query", 0.25)] * 2 and sampler.take() == []
    full = engine.prefill(torch.tensor([1, 2, 3, 4, 5, 6]), all_logits=False)[0][-1]
    assert samples[0].kl == pytest.approx(compare(full, torch.zeros(engine.cfg.vocab_size))[1])
    assert samples[0].computed_share == pytest.approx(1 / 6)  # 1 row of 6 at every layer
    sampler.close()


def test_a_generated_answer_is_compared_under_teacher_forcing_as_prefill_token_by_token_says(engine):
    """The shadow of a request that generated feeds full prefill the served answer and counts
    the tokens after the first it predicts as served: against one full prefill per position."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    logits, kv = engine.prefill(torch.tensor(prompt), all_logits=False)
    answer = list(greedy(engine, logits[-1], kv, 7).tokens)  # full prefill's own answer ...
    answer[3] = (answer[3] + 1) % engine.cfg.vocab_size  # ... with its 4th token changed, as a stale cache might
    served = torch.zeros(engine.cfg.vocab_size)
    served[answer[0]] = 1.0
    sampler = ShadowSampler(engine)
    result = dataclasses.replace(_result(engine, 8, True), logits=served)
    assert sampler.observe([prompt[:5], prompt[5:]], result, "query", 0.15, True, answer)
    assert sampler.observe([prompt], _result(engine, 8, True), "query", 0.15, True, list(range(40)))
    sampler.wait()
    short, long_ = sampler.take()
    by_prefill = [int(engine.prefill(torch.tensor(prompt + answer[:i]), all_logits=False)[0][-1].argmax()) == answer[i]
                  for i in range(1, len(answer))]
    assert (short.answer_tokens, short.answer_agree) == (6, sum(by_prefill))
    assert by_prefill[:3] == [True, True, False]  # the changed token is not full prefill's
    assert short.top1_agree and short.kl == pytest.approx(compare(logits[-1], served)[1])
    assert long_.answer_tokens == ANSWER_TOKENS  # at most 16 tokens after the first
    assert sampler.cost().shadow_row_layers == (8 + 6 + 8 + ANSWER_TOKENS) * engine.cfg.num_layers
    sampler.close()


def test_a_shadow_blend_compares_the_budget_below_from_the_kv_the_request_was_served_from(engine):
    """A Plan naming a budget below: the request's stored KV is copied as it arrives, and the
    shadow blends the request again at that budget from the copy. Its sample equals a blend at
    that budget from the stored KV itself, compared with full prefill in plain torch."""
    p = make_prompt(engine, seed=4, behind="other", chunk_len=24, n_chunks=4)
    segments = p.segments()
    stored = {i: v.kv for i, v in p.cache.items()}
    reference = blend_prefill(engine, segments, Policy("query", budget=0.05), InMemoryLayerSource(copy.deepcopy(stored)),
                              gate=TRUSTED, stats=False)
    recording = RecordingLayerSource(InMemoryLayerSource(stored))
    served = blend_prefill(engine, segments, Policy("query", budget=0.25), recording, gate=TRUSTED, stats=False)
    below = ShadowBlend(segments, Policy("query", budget=0.05), 0.05, recording.replay())
    sampler = ShadowSampler(engine)
    spans = [s.tokens for s in segments]
    assert sampler.can_blend()
    assert sampler.observe(spans, served, "query", 0.25, True, below=below)
    sampler.wait()
    mine, blended = sampler.take()
    full = engine.prefill(torch.tensor([t for s in spans for t in s]), all_logits=False)[0][-1]
    p_full, q = torch.log_softmax(full.double(), 0), torch.log_softmax(reference.logits.double(), 0)
    assert (mine.budget, mine.shadow_blend, blended.shadow_blend) == (0.25, False, True)
    assert blended.budget == pytest.approx(0.05) and blended.policy == "query" and blended.answer_tokens == 0
    assert blended.top1_agree == (int(full.argmax()) == int(reference.logits.argmax()))
    assert blended.kl == pytest.approx(float((p_full.exp() * (p_full - q)).sum()), rel=1e-6, abs=1e-9)
    assert blended.computed_share == pytest.approx(reference.computed_share)
    assert mine.kl != pytest.approx(blended.kl)  # the two budgets are told apart
    cost = sampler.cost()
    n, layers = sum(map(len, spans)), engine.cfg.num_layers
    assert cost.shadow_blends == 1 and cost.shadow_row_layers == n * layers + sum(reference.computed_rows)
    assert sampler.can_blend()  # the copy is let go once its blend ran
    sampler.close()


def test_the_engines_served_prefills_hold_back_wait_idle_until_the_last_ends():
    """`Serving.wait_idle` returns at once on an idle engine, not while a served prefill runs,
    and as soon as the last one ends."""
    import threading

    from engine_adapter.fidelity import Serving

    serving = Serving()
    assert serving.wait_idle(0.0)
    inside, leave, waited = threading.Event(), threading.Event(), threading.Event()

    def served() -> None:
        with serving.prefill(), serving.prefill():  # two adapters' prefills at once
            inside.set()
            leave.wait(60)

    t = threading.Thread(target=served)
    t.start()
    inside.wait(60)
    assert not serving.wait_idle(0.05)  # still serving: the bound ran out
    waiter = threading.Thread(target=lambda: serving.wait_idle(60) and waited.set())
    waiter.start()
    assert not waited.wait(0.2)
    leave.set()
    assert waited.wait(60)
    t.join()
    waiter.join()


def test_a_shadow_gives_way_to_served_prefills_before_each_model_call(engine):
    """Every call a shadow makes of the model (embedding, each layer's two, the logits) first
    waits for the engine's served prefills; the sample is the same full prefill's."""
    from engine_adapter.fidelity import Serving

    class Counting(Serving):
        waits = 0

        def wait_idle(self, timeout: float) -> bool:
            Counting.waits += 1
            return super().wait_idle(timeout)

    sampler = ShadowSampler(engine, Counting())
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    served = engine.prefill(torch.tensor(prompt), all_logits=False)[0][-1]
    result = dataclasses.replace(_result(engine, len(prompt), True), logits=served)
    assert sampler.observe([prompt[:5], prompt[5:]], result, "query", 0.25, True)
    sampler.wait()
    (sample,) = sampler.take()
    assert sample.top1_agree and sample.kl == pytest.approx(0.0, abs=1e-9)
    assert Counting.waits == 2 * engine.cfg.num_layers + 2
    sampler.close()
