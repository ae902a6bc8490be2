"""Sampled shadow prefills (engine_adapter.fidelity): the comparison and which requests are sampled."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_adapter.driver import BlendResult
from engine_adapter.fidelity import ANSWER_TOKENS, ShadowSampler, compare
from engine_adapter.generate import greedy


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
