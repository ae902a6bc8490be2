"""Blended prefill against full prefill: exactness at 100%, quality between naive and full,
RoPE exactness, fallbacks for late/missing/corrupt layers, statistics of fresh chunks."""

from __future__ import annotations

import logging
import time
from unittest import mock

import pytest
import torch
from transformers import LlamaForCausalLM

from .adapter_helpers import make_prompt, rel_dev, variant
from engine_adapter.blend import blend_prefill
from engine_adapter.llama import rope_for_spec
from engine_adapter.policy import Policy
from engine_adapter.probe import TRUSTED
from engine_adapter.prompt import Segment
from engine_adapter.source import InMemoryLayerSource
from engine_adapter.stats import FreshStats
from kvcraft.keys import chunk_key
from kvkernels import apply_rope, attention_mass


@pytest.fixture(scope="module")
def prompts(engine):
    return [make_prompt(engine, seed) for seed in range(3)]


def _blend(engine, prompt, policy, recompute=0.0, **kw):
    return blend_prefill(engine, prompt.segments(recompute), policy, kw.pop("source", prompt.source()),
                         gate=TRUSTED, **kw)


@pytest.mark.parametrize("policy,recompute", [
    (Policy("full"), 0.0), (Policy("cachecraft"), 1.0), (Policy("cacheblend", ratio=1.0), 0.0)])
def test_full_recompute_reproduces_full_prefill(engine, prompts, policy, recompute):
    p = prompts[0]
    ref_logits, ref_kv = engine.prefill(p.tokens)
    r = _blend(engine, p, policy, recompute)
    assert (r.logits - ref_logits[-1]).abs().max() < 1e-4
    for (k, v), (rk, rv) in zip(r.kv, ref_kv, strict=True):
        assert (k - rk).abs().max() < 1e-4 and (v - rv).abs().max() < 1e-4


def test_naive_reuse_deviates_measurably(engine, prompts):
    p = prompts[0]
    r = _blend(engine, p, Policy("naive"))
    assert r.reuse and r.recomputed_rows == [0] * engine.cfg.num_layers
    assert rel_dev(r.logits, engine.prefill(p.tokens)[0][-1]) > 0.1


@pytest.mark.parametrize("name", ["cachecraft", "cacheblend"])
def test_partial_recompute_sits_between_naive_and_full_and_improves_with_ratio(engine, prompts, name):
    ratios = [0.15, 0.3, 0.5, 0.75]
    refs = [engine.prefill(p.tokens)[0][-1] for p in prompts]

    def mean_dev(policy, recompute=0.0):
        return sum(rel_dev(_blend(engine, p, policy, recompute).logits, ref)
                   for p, ref in zip(prompts, refs)) / len(prompts)

    naive = mean_dev(Policy("naive"))
    if name == "cachecraft":
        devs = [mean_dev(Policy("cachecraft"), r) for r in ratios]
    else:
        devs = [mean_dev(Policy("cacheblend", ratio=r)) for r in ratios]
    assert naive > devs[0] and devs[-1] > 1e-3  # strictly between naive and exact
    assert all(a > b for a, b in zip(devs, devs[1:])), devs


def test_cacheblend_filters_gradually(engine, prompts):
    p = prompts[0]
    r = _blend(engine, p, Policy("cacheblend", ratio=0.2, filter_layers=3))
    reused = sum(len(c) for c in p.chunks)
    # Every reused token on layer 0; from layer 1 on, the top of them by that layer's KV deviation.
    assert r.recomputed_rows[0] == reused
    assert r.recomputed_rows[1] > r.recomputed_rows[2] > r.recomputed_rows[3] >= 0.2 * reused
    assert r.recomputed_rows[3] <= 0.2 * reused + 1


def test_cacheblend_budget_is_the_measured_share_of_reused_row_layers(engine, prompts):
    # The budget names what is computed, layer 0 included (tiny: 4 layers, layer 0 = 25%).
    r = _blend(engine, prompts[0], Policy("cacheblend", budget=0.5))
    assert r.recompute_ratio == pytest.approx(0.5, abs=2 / r.reused_tokens)
    n = r.prompt_tokens
    assert r.computed_share == pytest.approx(sum(r.computed_rows) / (n * engine.cfg.num_layers))


def test_hkvd_selects_tokens_whose_stored_kv_is_wrong(engine):
    # Chunk 0 leads the prompt, so its variant computed alone is exact; the others were
    # computed behind unrelated chunks. HKVD must spend its budget on those only.
    p = make_prompt(engine, 12)
    p.cache[0] = variant(engine, [], p.chunks[0])
    n0 = len(p.chunks[0])
    r = _blend(engine, p, Policy("cacheblend", ratio=0.2, filter_layers=1), all_logits=True)
    selected = r.rows[r.rows < sum(len(c) for c in p.chunks)]  # reused rows run at the last layer
    assert len(selected) >= 0.2 * sum(len(c) for c in p.chunks) - 1
    assert not (selected < n0).any(), selected


def test_layer_0_kv_of_a_chunk_does_not_depend_on_its_prefix(engine):
    # Why HKVD cannot select on layer 0 (CacheBlend §4.3 says "the first layer"): layer-0
    # K/V are projections of the token embeddings, so a chunk computed behind another
    # prefix has exactly the layer-0 KV it has here; only from layer 1 on does it differ.
    p = make_prompt(engine, 11)
    here = blend_prefill(engine, [Segment(c) for c in p.chunks], Policy("full"), InMemoryLayerSource({}),
                         gate=TRUSTED).fresh
    elsewhere = p.cache  # each chunk computed behind an unrelated chunk
    for i in range(1, len(p.chunks)):
        (k0, v0), (k1, v1) = here[i].kv[:2]
        (k0o, v0o), (k1o, v1o) = elsewhere[i].kv[:2]
        torch.testing.assert_close(k0, k0o)
        torch.testing.assert_close(v0, v0o)
        assert (v1 - v1o).abs().max() > 1e-2


def test_reused_chunk_at_new_position_equals_computing_it_there_alone(engine):
    chunk = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(7)).tolist()
    stored = variant(engine, [], chunk)  # computed alone at positions 0..23
    assert stored.stats.a == 0 and stored.stats.prefix_attention == ()
    rope, start = rope_for_spec(engine.model_spec()), 301
    _, there = engine.prefill(torch.tensor(chunk), start_pos=start)
    pos = torch.arange(start, start + len(chunk))
    for (k, v), (k_there, v_there) in zip(stored.kv, there, strict=True):
        assert (apply_rope(k, pos, rope) - k_there).abs().max() < 1e-5
        assert (v - v_there).abs().max() < 1e-5


def test_prefix_policy_reuses_only_the_exact_prefix_run(engine):
    p = make_prompt(engine, 11, behind="same")
    other = make_prompt(engine, 12)
    p.cache[2] = variant(engine, [other.chunks[0]], p.chunks[2])  # behind another prefix: the run stops
    src = p.source()
    r = blend_prefill(engine, p.segments(), Policy("prefix"), src, gate=TRUSTED)
    assert r.reused_tokens == len(p.chunks[0]) + len(p.chunks[1])
    assert (r.logits - engine.prefill(p.tokens)[0][-1]).abs().max() < 1e-4  # a prefix cache is exact
    assert set(r.fresh) == {2, 3}


def test_missing_layer_is_computed_from_layer_zero_and_matches_full_prefill(engine, caplog):
    p = make_prompt(engine, 21, behind="same")  # exact stored KV: any error is the fallback's
    ref = engine.prefill(p.tokens)[0][-1]
    assert (_blend(engine, p, Policy("naive")).logits - ref).abs().max() < 1e-4
    with caplog.at_level(logging.WARNING, logger="engine_adapter.merge"):
        r = _blend(engine, p, Policy("naive"), source=p.source(withhold={(1, 2)}))
    assert r.fallbacks == [(1, 2)]
    assert (r.logits - ref).abs().max() < 1e-4
    assert r.recomputed_rows == [0, 0, len(p.chunks[1]), len(p.chunks[1])]
    assert sum("layer 2 of chunk(s) [1] absent" in m for m in caplog.messages) == 1


class _LateLayer(InMemoryLayerSource):
    """Layer `layer` of chunk `chunk` arrives `after_s` after it is asked for: a caller that
    waits that long gets it, one that does not finds it absent (no clock: the deadline decides)."""

    def __init__(self, kv, chunk: int, layer: int, after_s: float):
        super().__init__(kv)
        self.late, self.after_s, self.patience = (chunk, layer), after_s, {}

    def wait_layer(self, layer, deadline):
        self.patience[layer] = deadline - time.monotonic()
        got = super().wait_layer(layer, deadline)
        if layer == self.late[1] and self.patience[layer] < self.after_s:
            del got[self.late[0]]
        return got


@pytest.mark.parametrize("layer", [0, 2])
def test_a_late_layer_is_waited_for_while_falling_back_would_cost_more(engine, layer):
    """Rent or buy: a late layer is waited for up to what computing the live chunks' rows
    through every layer would cost, at the pass's rate so far (layer 0: the model's last
    pass's); one later than that falls back as before."""
    p = make_prompt(engine, 21, behind="same")
    policy = Policy("naive", layer_budget_s=0.0)
    on_time = _blend(engine, p, policy)
    price = sum(len(c) for c in p.chunks) * engine.cfg.num_layers  # the live rows through every layer
    soon = _LateLayer(p.source().kv, chunk=1, layer=layer, after_s=1e-4)  # behind the compute, and soon
    r = _blend(engine, p, policy, source=soon)
    assert r.fallbacks == [] and torch.equal(r.logits, on_time.logits)
    before = sum(t.compute_s for t in on_time.timings) / sum(on_time.computed_rows)  # the last pass's rate
    assert soon.patience[0] == pytest.approx(before * price, rel=0.05)
    rate = sum(t.compute_s for t in r.timings[:2]) / sum(r.computed_rows[:2])  # this pass's, layers 0-1
    assert soon.patience[2] == pytest.approx(rate * price, rel=0.05)
    never = _LateLayer(p.source().kv, chunk=1, layer=layer, after_s=3600.0)
    r = _blend(engine, p, policy, source=never)
    assert r.fallbacks == [(1, layer)]
    assert (r.logits - engine.prefill(p.tokens)[0][-1]).abs().max() < 1e-4


def test_a_fallback_leaves_the_fresh_chunks_statistics_as_computed_in_the_pass(engine):
    """A chunk stored behind another prefix, absent from layer 2 on, is caught up through
    layers 0-1, its recomputed K/V written over theirs; the fresh chunk after it attended to
    the stored K/V there, and its statistics (their mass computed after the pass) say so."""
    p = make_prompt(engine, 23)
    segments = p.segments()
    segments[2] = Segment(p.chunks[2])  # fresh
    source = lambda: p.source(withhold={(1, 2)})  # noqa: E731
    real = FreshStats.later
    with mock.patch.object(FreshStats, "later", lambda self, *a: self._computed(real(self, *a))):
        in_pass = blend_prefill(engine, segments, Policy("naive"), source(), gate=TRUSTED)
        stats = in_pass.fresh[2].stats
    after = blend_prefill(engine, segments, Policy("naive"), source(), gate=TRUSTED)
    assert in_pass.fallbacks == after.fallbacks == [(1, 2)]
    assert after.fresh[2].stats == stats
    assert stats.prefix_attention[1] > 0


def test_corrupt_layer_is_treated_as_missing(engine):
    p = make_prompt(engine, 21, behind="same")
    src = p.source()
    k, v = src.kv[2][0]
    src.kv[2] = [(k[:, :-1], v[:, :-1])] + list(src.kv[2][1:])  # layer 0 of chunk 2: wrong shape
    r = _blend(engine, p, Policy("naive"), source=src)
    assert r.fallbacks == [(2, 0)]
    assert (r.logits - engine.prefill(p.tokens)[0][-1]).abs().max() < 1e-4


class _NeverArrives:
    """A fetch that never delivers: returns at its deadline with nothing (deadline in the past)."""

    def __init__(self):
        self.budgets: list[float] = []

    def wait_layer(self, layer, deadline):
        self.budgets.append(deadline - time.monotonic())
        return {}


def test_source_that_never_delivers_yields_full_prefill(engine, prompts, monkeypatch):
    monkeypatch.setattr(engine, "row_layer_s", None)  # no pass has priced a fallback yet: layer_budget_s alone
    p, src = prompts[1], _NeverArrives()
    r = _blend(engine, p, Policy("cacheblend", ratio=0.15, layer_budget_s=0.0), source=src)
    assert (r.logits - engine.prefill(p.tokens)[0][-1]).abs().max() < 1e-4
    assert sorted(r.fallbacks) == [(c, 0) for c in range(4)]
    assert len(src.budgets) == 1 and src.budgets[0] <= 0.0  # asked once, then nothing is live
    assert len(r.timings) == engine.cfg.num_layers


def test_wait_deadline_is_the_per_layer_budget_before_any_pass_prices_a_fallback(engine, prompts, monkeypatch):
    monkeypatch.setattr(engine, "row_layer_s", None)
    src = _NeverArrives()
    _blend(engine, prompts[1], Policy("naive", layer_budget_s=0.25), source=src)
    assert 0.0 < src.budgets[0] <= 0.25


def test_fresh_chunks_carry_rope_free_kv_and_attention_stats(engine, tmp_path):
    g = torch.Generator().manual_seed(5)
    a, b, q = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (20, 24, 6))
    with mock.patch("engine_adapter.stats.attention_mass", side_effect=attention_mass) as mass:
        r = blend_prefill(engine, [Segment(a), Segment(b), Segment(q, question=True)], Policy("full"),
                          InMemoryLayerSource({}), gate=TRUSTED)
        assert set(r.fresh) == {0, 1}
        assert mass.call_count == 0  # the request's first token never waits for the statistics
        r.fresh[1].stats, r.fresh[0].stats
        assert mass.call_count == engine.cfg.num_layers  # at the first read, once for every chunk
    assert r.fresh[0].prefix == () and r.fresh[1].prefix == (chunk_key(engine.model_spec().fingerprint(), a),)
    # Independent truth: transformers' eager attention probabilities, same weights.
    engine.save_pretrained(tmp_path)
    hf = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        att = hf(torch.tensor([a + b + q]), output_attentions=True).attentions  # L x [1, H, N, N]
    A, B = slice(0, 20), slice(20, 44)
    L = len(att)
    inter = sum(x[0].mean(0)[B, A].sum() for x in att)  # eq. 3 summed over layers
    intra = sum(x[0].mean(0)[B, B].sum() for x in att)  # eq. 4
    tok = sum(x[0].mean(0)[B, A].sum(1) for x in att)  # eq. 14 input
    s = r.fresh[1].stats
    assert s.a == pytest.approx(float(inter) / (L * 24), abs=1e-5)
    assert s.b == pytest.approx(float(intra) / (L * 24), abs=1e-5)
    assert s.prefix_attention == pytest.approx([s.a], abs=1e-6)
    assert torch.allclose(torch.tensor(s.token_inter_attention), tok, atol=1e-5)
    assert r.fresh[0].stats.a == 0 and r.fresh[0].stats.b == pytest.approx(1.0, abs=1e-5)
    # Stored K is RoPE-free: rotating it to its positions gives the merged (post-RoPE) cache.
    rope = rope_for_spec(engine.model_spec())
    k_b, v_b = r.fresh[1].kv[2]
    assert torch.allclose(apply_rope(k_b, torch.arange(20, 44), rope), r.kv[2][0][:, B], atol=1e-6)
    assert torch.equal(v_b, r.kv[2][1][:, B])


def test_focused_chunk_detection_stops_recomputing_unfocused_chunks(engine, prompts):
    p = prompts[2]
    plain = _blend(engine, p, Policy("cachecraft"), 0.5)
    early = _blend(engine, p, Policy("cachecraft", focus_window=1), 0.5)
    assert plain.focused is None and early.focused is not None and early.focus_layer is not None
    L = early.focus_layer
    assert early.recomputed_rows[: L + 1] == plain.recomputed_rows[: L + 1]
    unfocused = [c for c in range(4) if c not in early.focused]
    assert unfocused, "the test prompt must leave some chunk unfocused"
    dropped = sum(len(p.segments(0.5)[c].recompute) for c in unfocused)
    assert early.recomputed_rows[L + 1] == plain.recomputed_rows[L + 1] - dropped


def test_question_must_be_last(engine):
    with pytest.raises(ValueError, match="last segment"):
        blend_prefill(engine, [Segment([1, 2], question=True), Segment([3])], Policy("full"),
                      InMemoryLayerSource({}))


def test_scheduled_source_delivers_arrived_layers_and_drops_late_ones(engine, prompts):
    from engine_adapter.source import ScheduledLayerSource

    p, now = prompts[0], time.monotonic()
    arrived = ScheduledLayerSource({0: p.cache[0].kv}, layer_interval_s=1.0, start=now - 100.0)
    assert set(arrived.wait_layer(3, deadline=now)) == {0}
    late = ScheduledLayerSource({0: p.cache[0].kv}, layer_interval_s=100.0, start=now)
    assert late.wait_layer(0, deadline=now - 1.0) == {}  # deadline already past: no wait, nothing
