"""The blend step as it runs on a GPU, run on the CPU: the engine's Triton kernels
(`LlamaEngine(triton=True)`: fused add+RMSNorm and SiLU-mul, rotation of q and k with the
write of the rows' K/V, attention masked by position returning the attention mass in the
same launch) under ``TRITON_INTERPRET=1``, against the plain-torch step on the same weights,
for every policy: the logits, the merged cache, the rows computed, a fresh chunk's
statistics (which read the mass) and a fallback's catch-up."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_adapter.blend import blend_prefill
from engine_adapter.llama import LlamaConfig, LlamaEngine
from engine_adapter.policy import POLICIES, Policy
from engine_adapter.probe import TRUSTED
from engine_adapter.prompt import Segment
from tests.engine_adapter.adapter_helpers import make_prompt, question_reads


@pytest.fixture(scope="module")
def engines() -> tuple[LlamaEngine, LlamaEngine]:
    torch_step = LlamaEngine.random(dataclasses.replace(LlamaConfig.named("tiny"), num_layers=3), seed=3, std=0.1)
    return torch_step, LlamaEngine(torch_step.cfg, torch_step.w, triton=True)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)  # fp32: reductions in another order


def test_full_prefill_on_the_triton_path_equals_the_torch_path(engines):
    torch_step, triton_step = engines
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0))
    ref, ref_kv = torch_step.prefill(tokens)
    got, kv = triton_step.prefill(tokens)
    _close(got, ref)
    for (k, v), (k0, v0) in zip(kv, ref_kv):
        _close(k, k0)
        _close(v, v0)


@pytest.mark.parametrize("policy", POLICIES)
def test_each_policy_on_the_triton_path_equals_the_torch_path(engines, policy: str):
    torch_step, triton_step = engines
    p = make_prompt(torch_step, seed=5, n_chunks=3, chunk_len=8, question_len=4)
    segments = p.segments()
    segments[2] = Segment(p.chunks[2])  # one fresh chunk: its statistics read the attention mass
    options = {"ratio": 0.3} if policy == "cacheblend" else {}
    runs = [blend_prefill(e, segments, Policy(policy, **options), p.source(), gate=TRUSTED)
            for e in (torch_step, triton_step)]
    ref, got = runs
    _close(got.logits, ref.logits)
    assert got.computed_rows == ref.computed_rows and got.recomputed_rows == ref.recomputed_rows
    assert got.reused_segments == ref.reused_segments
    for (k, v), (k0, v0) in zip(got.kv, ref.kv):
        _close(k, k0)
        _close(v, v0)
    assert set(got.fresh) == set(ref.fresh)
    assert ref.fresh[2].stats.a > 0  # behind two chunks: the mass was measured
    for s, fresh in ref.fresh.items():
        st, st0 = got.fresh[s].stats, fresh.stats
        for a, b in ((st.a, st0.a), (st.b, st0.b), (st.prefix_attention, st0.prefix_attention),
                     (st.token_inter_attention, st0.token_inter_attention)):
            assert a == pytest.approx(b, rel=1e-4, abs=1e-6)


def test_a_missing_layer_catches_up_on_the_triton_path_as_on_the_torch_path(engines):
    torch_step, triton_step = engines
    p = make_prompt(torch_step, 21, behind="same", chunk_len=12)  # exact stored KV: full prefill's logits
    full = torch_step.prefill(p.tokens)[0][-1]
    for e in engines:
        r = blend_prefill(e, p.segments(), Policy("naive"), p.source(withhold={(1, 2)}), gate=TRUSTED)
        assert r.fallbacks == [(1, 2)]
        assert (r.logits - full).abs().max() < 1e-4


@pytest.mark.parametrize("withhold", [(), ((1, 1),)], ids=["all_arrive", "a_chunk_falls_back"])
def test_the_question_phase_reads_on_the_triton_path_equal_the_torch_path(withhold):
    """The default's question pass: on the Triton path the attention adds the question's
    reads up inside its own launches; with a chunk caught up after a fallback (its rows run
    too), the reads count the question's rows alone, as on the torch path. Five layers: the
    pass runs 0..3, its reads counted at 1..3."""
    five = dataclasses.replace(LlamaConfig.named("tiny"), num_layers=5)
    torch_step = LlamaEngine.random(five, seed=3, std=0.1)
    triton_step = LlamaEngine(five, torch_step.w, triton=True)
    p = make_prompt(torch_step, seed=6, n_chunks=3, chunk_len=8, question_len=4)
    ref, got = (question_reads(e, p.segments(), p.source(withhold=withhold), deviation=True)
                for e in (torch_step, triton_step))
    assert ref.result.fallbacks == got.result.fallbacks == ([(1, 1)] if withhold else [])
    # layers 1..3 (the phase stops before the last), 4 question rows, each head's probabilities summing to 1
    assert ref.reads.sum().item() == pytest.approx(3 * 4 * five.num_heads, rel=1e-5)
    _close(got.reads, ref.reads)
    _close(got.deviation, ref.deviation)
