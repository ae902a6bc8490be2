"""The static steps (`engine_adapter.graphs`: the layer step over buffers kept per bucket of
shapes, padded, which CUDA captures as a graph; `dispatch`: which layer runs there), run on
the CPU over Triton's interpreter, the same code a capture records. The step is the eager
step's own code; what is tested here is what the buffers and the dispatcher add: padding, the
choice of rows over fixed slots, key positions and segments placed per prefill, carried rows,
against the eager blend on plain torch for every policy, against full prefill, through a
fallback, and what a capture needs (no host reads, no tensors made from host values inside the step) and what
buffers shared between prefills must never do (change a result after it is returned, or be
written by a second prefill at the same time)."""

from __future__ import annotations

import dataclasses
import random
import logging
from unittest import mock

import pytest
import torch

from engine_adapter import blend, graphs
from engine_adapter import step as layer_step
from engine_adapter.blend import blend_prefill
from engine_adapter.graphs import Bucket, StaticStep, StepFailed, StepGraphs
from engine_adapter.llama import LlamaConfig, LlamaEngine
from engine_adapter.policy import POLICIES, Policy
from engine_adapter.probe import TOLERANCE, TRUSTED
from engine_adapter.prompt import Layout, Segment
from tests.engine_adapter.adapter_helpers import make_prompt, question_reads
from tests.engine_adapter.test_host_reads import ENGINE_CODE, KERNEL_CODE, HostReads

CFG = dataclasses.replace(LlamaConfig.named("tiny"), num_layers=3)


def _static(eager: LlamaEngine, **steps: int) -> StepGraphs:
    """The engine's static steps; `steps`: smaller buckets than a deployment's (the
    interpreter's cost grows with the padded rows and tokens)."""
    return StepGraphs(eager, **steps)


def _blend(e: LlamaEngine, segments, policy, source, steps: StepGraphs | None = None):  # noqa: ANN001, ANN202
    return blend_prefill(e, segments, policy, source, gate=TRUSTED, steps=steps)


def _plain(e: LlamaEngine) -> LlamaEngine:
    """The same weights on plain torch (SDPA): the reference."""
    return LlamaEngine(e.cfg, e.w, triton=False)


def _both(e: LlamaEngine, segments, policy, source, steps: StepGraphs):  # noqa: ANN001, ANN202
    """(the reference: the blend on plain torch, eager; the blend on `e`'s static steps)."""
    return _blend(_plain(e), segments, policy, source), _blend(e, segments, policy, source, steps)


@pytest.fixture(scope="module")
def engines() -> tuple[LlamaEngine, StepGraphs]:
    eager = LlamaEngine(CFG, LlamaEngine.random(CFG, seed=3, std=0.1).w, triton=True)
    return eager, _static(eager, tokens_step=16, rows_step=8)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)  # fp32: matmuls over more rows, blocked otherwise


def _same_result(got, ref) -> None:  # noqa: ANN001
    _close(got.logits, ref.logits)
    assert got.computed_rows == ref.computed_rows and got.fallbacks == ref.fallbacks
    assert got.reused_segments == ref.reused_segments
    for (k, v), (k0, v0) in zip(got.kv, ref.kv, strict=True):
        _close(k, k0)
        _close(v, v0)


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "full"])
def test_each_policy_on_static_steps_equals_the_eager_step(engines, policy: str):
    eager, static = engines
    # 16-token chunks leave the default a budget to pick rows with (8: none, naive reuse)
    p = make_prompt(_plain(eager), seed=5, n_chunks=3, chunk_len=16 if policy == "query" else 8, question_len=4)
    options = {"ratio": 0.3} if policy == "cacheblend" else {}
    ref, got = _both(eager, p.segments(), Policy(policy, **options), p.source(), static)
    _same_result(got, ref)
    static_layers = [layer for layer, t in enumerate(got.timings) if t.static]
    # naive reuse, Cache-Craft's fixed rows and prefix reuse (the chunks it computes are new
    # variants: their statistics read the attention mass, over the bucket's segments) run
    # every layer static; so does CacheBlend, HKVD's choice at its filter layers (1, 2 here)
    # made inside the step (a `step.Choice` over the bucket's slots); the default its question
    # phase's (layers
    # 0..L-2, its reads added up in the bucket's buffer) and its second phase's
    # (`test_the_default_policys_second_phase_...` below: layer by layer, the two phases'
    # flags are one here). Not here: full prefill (no blend loop); APE's pass runs eagerly (its
    # question rows' attention is computed again in torch, `attention.rescaled_attention`).
    assert static_layers == ([] if policy == "ape" else [0, 1, 2])


def test_the_default_policys_second_phase_runs_every_layer_static_its_carried_question_rows_too(engines):
    """Its layer 0 takes the question's rows through layer 0 from the question phase (`selection.Carry`):
    their K/V written into the bucket's buffers before the step, as the eager merge writes them."""
    eager, static = engines
    p = make_prompt(_plain(eager), seed=5, n_chunks=3, chunk_len=16, question_len=4)
    passes, run = [], blend.run_pass

    def each(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        res = run(*args, **kwargs)
        passes.append((args[2].carry, [t.static for t in res.timings]))  # (before the passes' are joined)
        return res

    with mock.patch.object(blend, "run_pass", each):
        ref, got = [_blend(e, p.segments(), Policy("query"), p.source(), s)
                    for e, s in ((_plain(eager), None), (eager, static))]
    _same_result(got, ref)
    (_, _), (carry, _), (_, _), (carry_static, static_layers) = passes
    assert carry is not None and carry_static is not None
    assert static_layers == [True] * CFG.num_layers


@pytest.mark.parametrize("withhold", [(), ((2, 2),)], ids=["all_arrive", "a_chunk_falls_back"])
def test_the_question_phases_reads_on_static_steps_equal_the_torch_paths(withhold):
    """The default's question phase on static steps: its keys placed as the phase places
    them (fresh chunks' past the end), its reads added up in the bucket's buffer by the rows
    the bucket holds, its padded rows reading nothing; layer 1 with the deviation on measures
    it inside the step (a `step.Choice` keeping none of the reused rows); after a fallback the
    caught-up rows run the layer too and the question's rows' share is read beside the step. Five layers: the phase runs 0..3, its reads
    counted at 1..3."""
    five = dataclasses.replace(LlamaConfig.named("tiny"), num_layers=5)
    torch_step = LlamaEngine.random(five, seed=3, std=0.1)
    triton_step = LlamaEngine(five, torch_step.w, triton=True)
    static = _static(triton_step, tokens_step=16, rows_step=8)
    p = make_prompt(torch_step, seed=6, n_chunks=3, chunk_len=8, question_len=4)
    segments = p.segments()
    segments[1] = Segment(p.chunks[1])  # not reused: hidden from the question phase
    lay = Layout.of(segments, torch_step.model_spec().fingerprint())
    for deviation in (False, True):
        ref, got = (question_reads(e, segments, p.source(withhold=withhold), deviation=deviation, steps=s)
                    for e, s in ((torch_step, None), (triton_step, static)))
        assert ref.result.fallbacks == got.result.fallbacks == ([(2, 2)] if withhold else [])
        assert [t.static for t in got.result.timings] == [True] * 4
        assert ref.reads.sum().item() == pytest.approx(3 * 4 * five.num_heads, rel=1e-5)
        _close(got.reads, ref.reads)
        assert (got.deviation is None) == (ref.deviation is None) == (not deviation)
        if deviation:
            assert all((ref.deviation[lay.span(s)] > 0).all() for s in (0, 2))  # the reused chunks' rows
            _close(got.deviation, ref.deviation)


@pytest.mark.parametrize("policy", [Policy("naive"), Policy("cachecraft", focus_window=2),
                                    Policy("cacheblend", ratio=0.3)], ids=["naive", "alg1", "cacheblend"])
def test_a_fresh_chunks_statistics_on_static_steps_equal_the_eager_steps(engines, policy):
    """A chunk computed here is a new variant: its KV and statistics (Cache-Craft §3.1) read
    its rows' attention mass per segment, taken from the static step over the bucket's
    segments (the prompt's, empty ones, one past the prompt) and cut to the prompt's. With
    Alg. 1 deciding (`focus_window`), the question's mass too; with CacheBlend, the rows
    HKVD keeps (a `step.Choice` over the bucket's slots)."""
    eager, static = engines
    p = make_prompt(_plain(eager), seed=6, n_chunks=3, chunk_len=8, question_len=4)
    segments = p.segments()
    segments[1] = Segment(p.chunks[1])  # computed here
    ref, got = _both(eager, segments, policy, p.source(), static)
    _same_result(got, ref)
    assert all(t.static for t in got.timings)
    assert (got.focused, got.focus_layer) == (ref.focused, ref.focus_layer)
    mine, theirs = got.fresh[1], ref.fresh[1]
    for (k, v), (k0, v0) in zip(mine.kv, theirs.kv, strict=True):
        _close(k, k0)
        _close(v, v0)
    assert mine.stats.a == pytest.approx(theirs.stats.a, rel=1e-5)
    assert mine.stats.b == pytest.approx(theirs.stats.b, rel=1e-5)
    assert mine.stats.prefix_attention == pytest.approx(theirs.stats.prefix_attention, rel=1e-5)
    assert mine.stats.token_inter_attention == pytest.approx(theirs.stats.token_inter_attention, rel=1e-5, abs=1e-7)


def test_hkvds_choices_on_static_steps_equal_the_eager_steps_across_prompts_of_one_bucket():
    """CacheBlend's gradual filtering (§4.3) chosen inside the step (a `step.Choice` over the
    bucket's slots: the
    deviation, a stable sort and prefix sums over the bucket's slots), on 5 layers (filter
    layers 1-3): the rows each keeps, the prefill's logits and caches as the eager step's, for
    two prompts of other lengths in one bucket of tokens, whose candidates, kept counts and
    rows the buffers take in turn; the second with a chunk late at a filter layer (caught up,
    then among the rows the next choice sees)."""
    five = dataclasses.replace(LlamaConfig.named("tiny"), num_layers=5)
    torch_step = LlamaEngine.random(five, seed=4, std=0.1)  # makes the stored variants (fast)
    eager = LlamaEngine(five, torch_step.w, triton=True)
    static = _static(eager, tokens_step=16, rows_step=8)
    for seed, chunk_len, withhold in ((13, 12, ()), (15, 10, {(1, 2)})):
        p = make_prompt(torch_step, seed=seed, n_chunks=3, chunk_len=chunk_len, question_len=4)
        ref, got = _both(eager, p.segments(), Policy("cacheblend", ratio=0.2), p.source(withhold=withhold), static)
        _same_result(got, ref)
        assert got.fallbacks == ([(1, 2)] if withhold else [])
        assert all(t.static for t in got.timings)
        rows = got.computed_rows
        assert withhold or rows[0] > rows[1] > rows[2] > rows[3] == rows[4]  # each filter layer chose
    assert len({b.tokens for b in static.buckets()}) == 1


def test_exact_reuse_on_a_deployments_buckets_equals_full_prefill(engines):
    eager, _ = engines
    static = _static(eager)  # TOKENS_STEP, ROWS_STEP: most of the rows and tokens are padding here
    p = make_prompt(_plain(eager), seed=7, behind="same", n_chunks=3, chunk_len=8, question_len=4)
    full, full_kv = _plain(eager).prefill(p.tokens, all_logits=False)
    got = _blend(eager, p.segments(), Policy("naive"), p.source(), static)
    assert all(t.static for t in got.timings)
    assert static.buckets() == [Bucket(tokens=256, rows=64)]
    assert (got.logits - full[-1]).abs().max() <= TOLERANCE[torch.float32]
    for (k, v), (k0, v0) in zip(got.kv, full_kv, strict=True):
        _close(k, k0)
        _close(v, v0)


def test_a_layer_missing_midway_catches_up_over_the_static_caches(engines):
    eager, static = engines
    p = make_prompt(_plain(eager), 21, behind="same", chunk_len=12)  # exact stored KV: full prefill's logits
    full = _plain(eager).prefill(p.tokens, all_logits=False)[0][-1]
    ref, got = _both(eager, p.segments(), Policy("naive"), p.source(withhold={(1, 2)}), static)
    assert got.fallbacks == [(1, 2)]
    assert [t.static for t in got.timings] == [True, True, True]  # new rows from layer 2: another bucket
    _same_result(got, ref)
    assert (got.logits - full).abs().max() < 1e-4


def test_a_result_keeps_its_caches_when_the_next_prefill_reuses_the_bucket(engines):
    eager, static = engines
    first, second = (make_prompt(_plain(eager), seed, n_chunks=3, chunk_len=8, question_len=4) for seed in (8, 9))
    a = _blend(eager, first.segments(), Policy("naive"), first.source(), static)
    kept = [(k.clone(), v.clone()) for k, v in a.kv]
    b = _blend(eager, second.segments(), Policy("naive"), second.source(), static)
    assert all(t.static for t in a.timings + b.timings) and len(a.kv[0][0][0]) == len(b.kv[0][0][0])
    for (k, v), (k0, v0) in zip(a.kv, kept, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_a_second_prefill_at_the_same_time_runs_eagerly_and_leaves_the_buffers_alone(engines):
    eager, static = engines
    p = make_prompt(_plain(eager), seed=10, n_chunks=3, chunk_len=8, question_len=4)
    _blend(eager, p.segments(), Policy("naive"), p.source(), static)  # makes the bucket
    before = [(s.h.clone(), s.caches.K.clone(), s.caches.V.clone()) for s in static._steps.values()]
    q = make_prompt(_plain(eager), seed=11, n_chunks=3, chunk_len=8, question_len=4)
    with static.lease() as first:  # another prefill holds the static steps
        assert first
        got = _blend(eager, q.segments(), Policy("naive"), q.source(), static)
    ref = _blend(_plain(eager), q.segments(), Policy("naive"), q.source())
    assert not any(t.static for t in got.timings)
    _same_result(got, ref)
    for s, (h, K, V) in zip(static._steps.values(), before, strict=True):
        assert torch.equal(s.h, h) and torch.equal(s.caches.K, K) and torch.equal(s.caches.V, V)


class _CaptureBreakers(HostReads):
    """What a CUDA graph capture cannot hold: host reads of a device tensor and tensors made
    from host values (a copy from host memory), by engine and kernel code."""

    def __init__(self) -> None:
        super().__init__((ENGINE_CODE, KERNEL_CODE))

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if getattr(func, "__name__", "") in {"tensor", "as_tensor", "from_numpy"}:
            self.sites[f"made from host values: {func.__name__}"] += 1
        return super().__torch_function__(func, types, args, kwargs)


def test_a_static_step_reads_nothing_of_the_device_and_copies_nothing_from_the_host(engines):
    # every kind of static step: plain (Cache-Craft), with reads (the default's question
    # phase), with the attention mass (a fresh chunk's statistics), choosing rows (CacheBlend)
    eager, static = engines
    p = make_prompt(_plain(eager), seed=12, n_chunks=3, chunk_len=16, question_len=4)
    fresh = p.segments()
    fresh[1] = Segment(p.chunks[1])
    spy, runs = _CaptureBreakers(), []
    inner = StaticStep.run

    def watched(self, layer, *kinds):  # noqa: ANN001, ANN002, ANN202
        runs.append((layer, *kinds))
        with spy:
            return inner(self, layer, *kinds)

    with mock.patch.object(StaticStep, "run", watched):
        for policy, segments in ((Policy("cachecraft"), p.segments()), (Policy("query"), p.segments()),
                                 (Policy("naive"), fresh), (Policy("cacheblend", ratio=0.3), p.segments())):
            _blend(eager, segments, policy, p.source(), static)
    assert {(reads, bool(mass)) for _, reads, mass in runs} == {(False, False), (True, False), (False, True)}
    assert not spy.sites, dict(spy.sites)


def test_the_least_recently_used_buckets_go_first(engines):
    eager, _ = engines
    steps = StepGraphs(eager, tokens_step=16, rows_step=8)
    a, b, c = steps.bucket(10, 3), steps.bucket(20, 3), steps.bucket(40, 3)
    assert (a, b, c) == (Bucket(16, 8), Bucket(32, 8), Bucket(48, 8))
    assert steps.bucket(16, 9) == Bucket(32, 16)  # a position past the prompt for its padded rows
    steps.step(10, 3), steps.step(20, 3), steps.step(10, 3)
    steps.step(40, 3)  # a third bucket of tokens: b's caches (least recently used) and its rows go
    assert steps.buckets() == [a, c]


@pytest.mark.parametrize("policy", ["naive", "query"])
def test_a_step_that_fails_leaves_its_layer_and_every_later_prefill_to_the_eager_step(policy: str, caplog):
    """A CUDA graph that cannot be captured, or whose replay differs from its eager run
    (`StaticStep._capture`), raises StepFailed with the step's inputs as they were: the
    layer runs eagerly, so do the layers after it and every later prefill on the engine,
    said once in the log. Here the failure is raised where a capture would raise it."""
    eager = LlamaEngine(CFG, LlamaEngine.random(CFG, seed=3, std=0.1).w, triton=True)
    static = _static(eager, tokens_step=16, rows_step=8)
    p = make_prompt(_plain(eager), seed=5, n_chunks=3, chunk_len=16, question_len=4)
    run, calls = StaticStep.run, []

    def fails_at_layer_1(step, layer, *args):  # noqa: ANN001, ANN202
        calls.append(layer)
        if layer == 1:
            raise StepFailed("layer 1's CUDA graph: (raised by the test)")
        return run(step, layer, *args)

    ref = _blend(_plain(eager), p.segments(), Policy(policy), p.source())
    with mock.patch.object(StaticStep, "run", fails_at_layer_1), caplog.at_level(logging.WARNING):
        got = _blend(eager, p.segments(), Policy(policy), p.source(), static)
        again = _blend(eager, p.segments(), Policy(policy), p.source(), static)
    _same_result(got, ref)
    _same_result(again, ref)
    assert calls == [0, 1]  # layer 0 ran static; nothing after the failure
    assert [t.static for t in got.timings] == [True, False, False]
    assert not any(t.static for t in again.timings)
    assert [r.getMessage() for r in caplog.records if "static steps off" in r.getMessage()] == [
        "static steps off for this engine, prefills run eagerly: layer 1's CUDA graph: (raised by the test)"]


@pytest.mark.parametrize("policy", ["naive", "query"])
def test_no_device_memory_for_a_bucket_runs_the_prefill_eagerly_and_the_next_static(policy: str, caplog):
    """A bucket's buffers that the device has no memory for (`torch.OutOfMemoryError` where a
    bucket of tokens is made: the default policy asks for it before its first layer, for its
    reads) leave the prefill to the eager step, the buckets kept dropped and said in the log;
    the next prefill allocates afresh and runs static."""
    eager = LlamaEngine(CFG, LlamaEngine.random(CFG, seed=3, std=0.1).w, triton=True)
    static = _static(eager, tokens_step=16, rows_step=8)
    p = make_prompt(_plain(eager), seed=5, n_chunks=3, chunk_len=16, question_len=4)
    ref = _blend(_plain(eager), p.segments(), Policy(policy), p.source())
    made = graphs.Caches.__init__

    def no_memory(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")

    with mock.patch.object(graphs.Caches, "__init__", no_memory), caplog.at_level(logging.WARNING):
        got = _blend(eager, p.segments(), Policy(policy), p.source(), static)
    _same_result(got, ref)
    assert not any(t.static for t in got.timings) and not static.buckets()
    assert [r.getMessage() for r in caplog.records] == [
        "no device memory for the static steps' buffers of a 52-token prompt, the prefill runs eagerly: "
        "CUDA out of memory (raised by the test)"]
    assert graphs.Caches.__init__ is made
    again = _blend(eager, p.segments(), Policy(policy), p.source(), static)
    _same_result(again, ref)
    assert all(t.static for t in again.timings)


def test_a_choosing_steps_choice_is_the_stable_top_k_of_its_candidates_whatever_the_counts(engines):
    """A static step's choice (`step.Choice` over the bucket's slots) on its own, against a
    brute-force one on the host: for
    random rows, candidates and kept counts (none, all, a full bucket with no spare slot, no
    candidate) and deviations with many ties (made here), the rows out are the rows that are
    not candidates and the `keep` candidates of highest deviation, ties to the earlier one, in
    order; the kept candidates' places among them; spare slots at the padding position."""
    eager, _ = engines
    steps = StepGraphs(eager, tokens_step=16, rows_step=8)
    rng = random.Random(0)
    n = 40
    cases = [(8, 0, 0), (8, 8, 8), (8, 8, 0), (5, 3, 3), (16, 12, 5)] + [
        (R, rng.randint(0, R), None) for R in (rng.randint(1, 24) for _ in range(12))]
    for R, C, keep in cases:
        keep = rng.randint(0, C) if keep is None else keep
        rows = sorted(rng.sample(range(n), R))
        cand = sorted(rng.sample(range(R), C))
        static = steps.step(n, R, R - C + keep)
        ties = torch.tensor([float(rng.randint(0, 3)) for _ in range(static.rows.count)])
        static.load(torch.tensor(rows), torch.randn(R, eager.cfg.hidden_size))
        static.choose(torch.tensor(cand, dtype=torch.long), keep)
        with mock.patch.object(layer_step, "kv_deviation", lambda *kv: ties.clone()):
            static.run(0)
        by_rank = sorted(range(C), key=lambda i: (-ties[i].item(), i))[:keep]  # stable, descending
        chosen = {cand[i] for i in by_rank}
        stay = [r for i, r in enumerate(rows) if i not in set(cand) or i in chosen]
        R2 = len(stay)
        out = static.out_rows.rows
        assert out[:R2].tolist() == stay, (R, C, keep)
        assert (out[R2:] == steps.bucket(n, 1).tokens - 1).all()
        assert static.cand_out[:keep].tolist() == [stay.index(rows[i]) for i in sorted(chosen)]


def test_a_replay_is_judged_against_its_eager_run_by_each_outputs_largest_value():
    """`graphs.replay_differs`, what turns the static steps off on CUDA: a rounding apart
    passes, an output off by more than 1% of its largest value, or NaN, does not; an output
    the step does not make (no mass) is not compared."""
    h, qkv = torch.randn(8, 16), torch.randn(3, 8, 4)
    assert graphs.replay_differs((h, qkv, None), (h * (1 + 1e-3), qkv.clone(), torch.full((8, 2), float("nan")))) == ""
    wrong = h.clone()
    wrong[3, 5] += 0.02 * h.abs().max()
    assert "hidden states differ" in graphs.replay_differs((h, qkv, None), (wrong, qkv, None))
    nan = qkv.clone()
    nan[0, 0, 0] = float("nan")
    assert "q/k/v differ" in graphs.replay_differs((h, qkv, None), (h, nan, None))
