"""Policy rules on their own: prefix run, HKVD ratio schedule, Alg. 1 focused chunks."""

from __future__ import annotations

import math

import pytest

from engine_adapter.policy import FocusTracker, Policy, focused_chunks
from engine_adapter.prompt import Layout, Segment
from engine_adapter.selection import LayerView


def test_prefix_run_stops_at_the_first_chunk_cached_behind_another_prefix():
    lay = Layout.of([Segment([1, 2], key="a"), Segment([3], key="b"), Segment([4], key="c"),
                     Segment([5], key="d"), Segment([6], question=True)], "model")
    segs = [Segment([1, 2], key="a", cached=True), Segment([3], key="b", cached=True, cached_prefix=("a",)),
            Segment([4], key="c", cached=True, cached_prefix=("x",)),
            Segment([5], key="d", cached=True, cached_prefix=("a", "b", "c")), lay.segments[-1]]
    lay = Layout.of(segs, "model")
    assert Policy("prefix").reused(lay) == [0, 1]
    assert Policy("naive").reused(lay) == [0, 1, 2, 3]
    assert Policy("full").reused(lay) == []


def test_hkvd_ratios_fall_from_r1_to_r_then_stay():
    p = Policy("cacheblend", ratio=0.2, first_ratio=0.5, filter_layers=4)
    ratios = [p.hkvd_share(layer, 7) for layer in range(7)]
    # Layer 0 runs every reused token: its K/V cannot deviate (test_blend_prefill).
    assert ratios[0] is None
    assert ratios[1:5] == pytest.approx([0.5, 0.4, 0.3, 0.2])
    assert ratios[5:] == [None, None]
    # the plug-in's choice at each layer: that share of the reused tokens among the candidates
    lay = Layout.of([Segment([1] * 20, cached=True), Segment([2], question=True)], "model")
    hkvd = p.selection(None)
    keeps = [hkvd.choice(LayerView(lay, layer, 7, tuple, 10, 20, (0,), (20,))) for layer in range(7)]
    assert keeps == [None, 10, 8, 6, 4, None, None]


def test_policy_validation():
    for bad in (dict(name="lru"), dict(name="cacheblend", ratio=1.5),
                dict(name="cacheblend", ratio=0.3, first_ratio=0.2), dict(name="naive", layer_budget_s=-1)):
        with pytest.raises(ValueError):
            Policy(**bad)


def test_focused_chunks_are_a_top_run_of_the_ranking():
    scores = [0.1, 5.0, 0.3, 4.0, 0.2]
    f = focused_chunks(scores)
    ranking = sorted(range(5), key=lambda i: -scores[i])
    assert f == frozenset(ranking[: len(f)]) and 1 <= len(f) <= 3
    assert focused_chunks([1.0, 2.0]) == {0, 1}  # too few chunks to cut
    assert focused_chunks([1.0, 1.0, 1.0]) == {0, 1, 2}  # no gap: nothing to cut


def test_focus_tracker_decides_after_window_stable_layers():
    t = FocusTracker([10, 11, 12, 13], window=2)
    seq = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 5, 0, 0], [0, 5, 0, 0], [0, 5, 0, 0]]
    decided = [t.update(layer, x) for layer, x in enumerate(seq)]
    first = next(i for i, d in enumerate(decided) if d is not None)
    assert t.layer == first and t.focused == decided[first]
    assert first >= 2 and 11 in t.focused
    assert all(d is None for d in decided[first + 1:])  # decided once
    assert FocusTracker([0, 1, 2], window=0).update(0, [1, 2, 3]) is None


def test_policy_by_name_is_an_object_of_its_kind_and_refuses_options_it_lacks():
    from engine_adapter.policy import CacheBlend, CacheCraft, Full

    assert isinstance(Policy("full"), Full) and isinstance(Policy("cachecraft", focus_window=2), CacheCraft)
    assert Policy("cacheblend", ratio=0.3) == CacheBlend(ratio=0.3)
    with pytest.raises(ValueError, match="no option"):
        Policy("naive", ratio=0.3)  # naive recomputes nothing: a ratio would be silently ignored
    with pytest.raises(ValueError, match="ratio or a budget"):
        Policy("cacheblend", ratio=0.2, budget=0.2)


@pytest.mark.parametrize("name, option, bad, good, message", [
    ("epic", "tokens", 1.5, 8, "tokens must be a whole number, got 1.5"),
    ("cachecraft", "focus_window", math.nan, 2, "focus_window must be a whole number, got nan"),
    ("cacheblend", "filter_layers", True, 2, "filter_layers must be a whole number, got True"),
    ("naive", "layer_budget_s", math.inf, 30, "layer_budget_s must be a finite number, got inf"),
    ("query", "budget", "0.2", 0.2, "budget must be a finite number, got '0.2'"),
    ("cacheblend", "ratio", [0.1], 0.1, r"ratio must be a finite number, got \[0.1\]"),
    ("ape", "scale", math.inf, 2.0, "scale must be a finite number, got inf"),
    ("ape", "temperature", 1e-40, 0.01, r"temperature 1e-40 outside \[0.01, 1\]"),
])
def test_an_option_of_the_wrong_kind_is_refused_by_name(name, option, bad, good, message):
    # Options reach a policy from requests (vLLM's kv_transfer_params, JSON). Each bad value here was
    # taken before: a count that is none failed inside the blend, an infinite wait could wait on a
    # stalled service without end, APE's logits over a tiny temperature overflowed to NaN.
    with pytest.raises(ValueError, match=message):
        Policy(name, **{option: bad})
    assert getattr(Policy(name, **{option: good}), option) == good


@pytest.mark.parametrize("layers,budget", [(12, 0.15), (8, 0.15), (32, 0.15), (4, 0.5), (4, 0.9)])
def test_cacheblend_budget_schedule_sums_to_the_budget_layer_0_included(layers, budget):
    p = Policy("cacheblend", budget=budget)
    shares = [1.0] + [p.hkvd_share(layer, layers) for layer in range(1, min(layers, 4))]
    shares += [shares[-1]] * (layers - len(shares))  # the set stays after the filter layers
    assert sum(shares) / layers == pytest.approx(budget, abs=1e-6)
    assert shares[1] >= shares[2] >= shares[3]


def test_cacheblend_budget_below_layer_0_alone_is_refused():
    with pytest.raises(ValueError, match="below layer 0"):
        Policy("cacheblend", budget=0.15).hkvd_share(1, 4)  # layer 0 of 4 is already 25%
