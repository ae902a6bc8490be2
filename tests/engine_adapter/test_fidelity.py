"""Sampled shadow prefills (engine_adapter.fidelity): the comparison and which requests are sampled."""

from __future__ import annotations

import pytest
import torch

from engine_adapter.driver import BlendResult
from engine_adapter.fidelity import ShadowSampler, compare


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
