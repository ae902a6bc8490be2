"""The blend loop's static steps as CUDA graphs (`graphs.StepGraphs` on CUDA): each
layer captured at its first use and replayed for later prompts of its bucket, against the
eager step on the same weights and against full prefill. The CPU half (the same steps
uncaptured, in Triton's interpreter) is tests/engine_adapter/test_static_steps.py."""

from __future__ import annotations

import pytest
import torch

from engine_adapter import LlamaEngine, Policy
from engine_adapter.blend import blend_prefill
from engine_adapter.graphs import StepGraphs
from engine_adapter.probe import TOLERANCE, TRUSTED
from engine_adapter.prompt import Segment
from tests.engine_adapter.adapter_helpers import make_prompt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("policy", ["naive", "cachecraft", "cacheblend", "query"])
def test_graphs_replayed_across_prompts_give_the_eager_steps_logits(policy: str):
    cpu = LlamaEngine.random("tiny", seed=0, std=0.1)
    weights = {n: w.cuda() for n, w in cpu.w.items()}
    eager = LlamaEngine(cpu.cfg, weights)
    graphed = StepGraphs(eager)
    options = {"ratio": 0.3} if policy == "cacheblend" else {}
    results = []
    with torch.device("cuda"):
        for seed in (1, 2, 3):  # one bucket: the first prompt captures, the others replay
            p = make_prompt(cpu, seed, n_chunks=4, chunk_len=24)
            for v in p.cache.values():
                v.kv[:] = [(k.cuda(), x.cuda()) for k, x in v.kv]
            ref, got = (blend_prefill(eager, p.segments(), Policy(policy, **options), p.source(), gate=TRUSTED,
                                      steps=s) for s in (None, graphed))
            assert not graphed.failed, graphed.failed
            assert any(t.static for t in got.timings)
            torch.testing.assert_close(got.logits, ref.logits, atol=1e-4, rtol=1e-4)
            results.append((got, [(k.clone(), v.clone()) for k, v in got.kv]))
    assert all(s.graphs for s in graphed._steps.values())
    for got, kept in results:  # a result's caches are its own, not the bucket's
        for (k, v), (k0, v0) in zip(got.kv, kept, strict=True):
            assert torch.equal(k, k0) and torch.equal(v, v0)


def test_graphs_returning_the_attention_mass_give_a_fresh_chunks_statistics_as_the_eager_step():
    cpu = LlamaEngine.random("tiny", seed=0, std=0.1)
    weights = {n: w.cuda() for n, w in cpu.w.items()}
    eager = LlamaEngine(cpu.cfg, weights)
    graphed = StepGraphs(eager)
    p = make_prompt(cpu, 5, n_chunks=4, chunk_len=24)
    for v in p.cache.values():
        v.kv[:] = [(k.cuda(), x.cuda()) for k, x in v.kv]
    with torch.device("cuda"):
        segments = p.segments()
        segments[1] = Segment(p.chunks[1])  # computed here: a new variant
        for _ in range(2):  # captured, then replayed
            ref, got = (blend_prefill(eager, segments, Policy("naive"), p.source(), gate=TRUSTED, steps=s)
                        for s in (None, graphed))
            assert not graphed.failed, graphed.failed
            assert all(t.static for t in got.timings)
            torch.testing.assert_close(got.logits, ref.logits, atol=1e-4, rtol=1e-4)
            assert got.fresh[1].stats.token_inter_attention == pytest.approx(
                ref.fresh[1].stats.token_inter_attention, rel=1e-4, abs=1e-6)


def test_exact_reuse_on_graphs_equals_full_prefill():
    cpu = LlamaEngine.random("tiny", seed=0, std=0.1)
    engine = LlamaEngine(cpu.cfg, {n: w.cuda() for n, w in cpu.w.items()})
    graphed = StepGraphs(engine)
    p = make_prompt(cpu, 4, behind="same", n_chunks=4, chunk_len=24)
    full = cpu.prefill(p.tokens, all_logits=False)[0][-1]
    for v in p.cache.values():
        v.kv[:] = [(k.cuda(), x.cuda()) for k, x in v.kv]
    with torch.device("cuda"):
        for _ in range(2):  # captured, then replayed
            got = blend_prefill(engine, p.segments(), Policy("naive"), p.source(), gate=TRUSTED, steps=graphed)
            assert not graphed.failed, graphed.failed
            assert all(t.static for t in got.timings)
            tolerance = TOLERANCE[torch.float32] * max(1.0, float(full.abs().max()))
            assert (got.logits.cpu() - full).abs().max() <= tolerance
