"""The recompute budget shared by the planner and the engine adapter (kvcraft.recompute)."""

from __future__ import annotations

import pytest

from kvcraft import recompute


def test_allocate_spends_one_budget_across_chunks():
    scores = {0: [0.1, 0.2, 0.0, 0.0], 2: [0.9, 0.0, 0.5, 0.05]}
    assert recompute.allocate(scores, 0.25) == {0: (), 2: (0, 2)}  # 0.25 * 8 = 2 tokens
    assert recompute.allocate(scores, 0.37) == {0: (), 2: (0, 2)}  # floor: never over the budget
    assert recompute.allocate(scores, 0.0) == {0: (), 2: ()}
    # a token scored 0 cost nothing where it was measured: never chosen, whatever the budget
    assert recompute.allocate(scores, 1.0) == {0: (0, 1), 2: (0, 2, 3)}
    with pytest.raises(ValueError, match="budget"):
        recompute.allocate(scores, 1.5)


def test_per_chunk_takes_the_same_share_of_every_chunk_and_order_breaks_ties_by_index():
    assert recompute.per_chunk({0: [0.1, 0.3, 0.2], 1: [5.0, 1.0, 1.0, 1.0, 0.0]}, 0.3) == {0: (1,), 1: (0, 1)}
    assert recompute.order([1.0, 2.0, 2.0, 0.0]) == (1, 2, 0, 3)
    assert recompute.merge_scores((), [1, 2]) == (1.0, 2.0)
    assert recompute.merge_scores((3.0, 1.0), [1, 2]) == (3.0, 2.0)
