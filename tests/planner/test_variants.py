import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import kendalltau

from kvservice.planner.variants import (
    adjusted_beta, beta, cci, cfo, choose_variant, discordant_pairs, fr_increment, gamma,
    recompute_count, recompute_tokens, variant_cfo,
)

from .helpers import key, variant

C1, C2, C3, C4, X = key("C1"), key("C2"), key("C3"), key("C4"), key("X")


def pos(seq):
    return {k: i for i, k in enumerate(seq)}


@settings(max_examples=300, deadline=None)
@given(st.permutations(list(range(8))).flatmap(lambda p: st.tuples(st.just(p), st.integers(2, 8))))
def test_gamma_matches_scipy_kendall_tau(args):
    perm, m = args
    common = [key(i) for i in range(m)]
    s_old = common  # old order 0..m-1
    s_new = [key(i) for i in perm if i < m]
    tau = kendalltau(list(range(m)), [s_new.index(k) for k in s_old]).statistic
    n_pairs = m * (m - 1) / 2
    discordant = (1 - tau) * n_pairs / 2  # no ties: tau = (C - D) / n_pairs, C + D = n_pairs
    assert gamma(s_old, pos(s_new)) == pytest.approx(discordant / n_pairs)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 20), max_size=9, unique=True))
def test_discordant_pairs_is_brute_force_inversions(seq):
    expected = sum(1 for i in range(len(seq)) for j in range(len(seq)) if i < j and seq[i] > seq[j])
    assert discordant_pairs(seq) == expected


def test_cache_craft_order_example_c1c2c3_vs_c3c1c2():
    # Cache-Craft §3.1: beta is 1 for both orders of the same prefix chunks; gamma
    # tells them apart. Variant of X cached behind C1-C2-C3.
    v = variant(X, [C1, C2, C3], a=1.0, b=1.0, prefix_attention=[0.2, 0.3, 0.5])
    same, moved = pos([C1, C2, C3]), pos([C3, C1, C2])
    assert beta(v.prefix_keys, v.stats.prefix_attention, same) == 1.0
    assert beta(v.prefix_keys, v.stats.prefix_attention, moved) == 1.0
    assert gamma(v.prefix_keys, same) == 0.0
    # A_old = C1 C2 C3 at new positions 1 2 0: pairs (C1,C3), (C2,C3) discordant -> 2/3
    assert gamma(v.prefix_keys, moved) == pytest.approx(2 / 3)
    assert variant_cfo(v, same, alpha=1.0) == 0.0
    expected = 1.0 * (1 / (1 + math.exp(-1.0))) * (1 - 1.0 * (1 - 2 / 3))
    assert variant_cfo(v, moved, alpha=1.0) == pytest.approx(expected)


def test_beta_weights_overlap_by_inter_attention():
    # Cache-Craft eq. 6: C3 cached behind C1 C2; new prefix holds C1 only.
    assert beta([C1, C2], [0.75, 0.25], {C1}) == pytest.approx(0.75)
    assert beta([C1, C2], [0.75, 0.25], {C4}) == 0.0


def test_edge_cases():
    assert beta([], [], {}) == 1.0          # alone, placed alone: same context
    assert beta([], [], {C1: 0}) == 0.0     # alone, now behind C1
    assert beta([C1, C2], [0.0, 0.0], {C1}) == 0.5  # no attention measured: unweighted
    assert gamma([C1], pos([C1, C2])) == 0.0  # m < 2
    assert cci(0.3, 0.0) == 1.0             # b == 0: conservative
    assert cci(0.0, 1.0) == 0.5
    assert cfo(2.0, 0.9, 0.0) == 1.0        # clamped
    assert adjusted_beta(0.8, 0.25) == pytest.approx(0.6)
    assert recompute_count(0.1, 10) == 1    # float noise does not round up to 2
    assert recompute_count(0.101, 10) == 2
    assert fr_increment(0.0) == 100.0 and fr_increment(0.5) == 2.0


def test_chooses_lowest_cfo_and_recomputes_top_tokens():
    tia = [0.1, 0.9, 0.3, 0.8, 0.0]
    alone = variant(X, [], tokens=5, b=1.0)
    behind_c1c2 = variant(X, [C1, C2], tokens=5, a=0.5, b=1.0, token_inter=tia)
    behind_c4 = variant(X, [C4], tokens=5, a=0.1, b=1.0)
    s_new = pos([C1, C2])
    choice = choose_variant([alone, behind_c4, behind_c1c2], s_new, alpha=1.0)
    assert choice.info is behind_c1c2 and choice.cfo == 0.0
    assert recompute_tokens(behind_c1c2, 0.4) == (1, 3)  # N = ceil(0.4 * 5) = 2, by attention
    s_new = pos([C2, C1])  # same chunks, swapped: gamma = 1 -> beta' = 0
    choice = choose_variant([alone, behind_c4, behind_c1c2], s_new, alpha=1.0)
    assert choice.info is alone and choice.cfo == pytest.approx(0.5)  # CCI(a=0) = 0.5
    assert choose_variant([], s_new) is None
    assert choose_variant([behind_c4], pos([C1]), alpha=1.0, max_cfo=0.4) is None


def test_tie_goes_to_faster_tier():
    slow = variant(X, [C1], tier="disk")
    fast = variant(X, [C1, C2], tier="gpu")
    # both exact on their overlap (beta 1): CFO 0 for both; neither behind exactly C1 C2 C3
    assert choose_variant([slow, fast], pos([C1, C2, C3]), alpha=1.0).info is fast
    assert choose_variant([fast, slow], pos([C1, C2, C3]), alpha=1.0).info is fast


def test_among_variants_of_cfo_0_the_one_behind_exactly_the_chunks_before_it_wins():
    """Its KV is what full prefill computes (what exact reuse, a prefix cache's, serves); the
    others of CFO 0 have the same chunks before them in another layout, on a faster tier too."""
    exact = variant(X, [C1, C2], tier="disk")
    subset, other_order = variant(X, [C1], tier="gpu"), variant(X, [C2, C1], tier="gpu")
    assert variant_cfo(subset, pos([C1, C2]), alpha=1.0) == variant_cfo(exact, pos([C1, C2]), alpha=1.0) == 0.0
    for variants in ([subset, exact], [exact, subset]):
        assert choose_variant(variants, pos([C1, C2]), alpha=1.0).info is exact
    assert choose_variant([subset, other_order], pos([C1, C2]), alpha=1.0).info is subset  # CFO 0 against > 0
    assert choose_variant([variant(X, [], tier="disk"), variant(X, [], tier="gpu")], {}).info.tier == "gpu"


prefixes = st.lists(st.sampled_from([key(i) for i in range(6)]), max_size=5, unique=True)


@settings(max_examples=300, deadline=None)
@given(prefixes, prefixes, st.floats(0, 3), st.floats(0, 2), st.booleans(), st.floats(0.1, 2))
def test_fused_cfo_equals_composed_equations(old, new, a, b, zero_attention, alpha):
    pa = [0.0] * len(old) if zero_attention else [0.1 * (i + 1) for i in range(len(old))]
    v = variant(X, old, a=a, b=b, prefix_attention=pa)
    s_new = pos(new)
    st_ = v.stats
    expected = cfo(alpha, cci(st_.a, st_.b),
                   adjusted_beta(beta(old, pa, s_new), gamma(old, s_new)))
    assert variant_cfo(v, s_new, alpha) == pytest.approx(expected)
