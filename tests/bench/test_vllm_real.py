"""kvbench.vllm.real's pure parts: output comparison, the warm pass's chunk order, the paired
difference of two paths' scores and the budgets a path ran with."""

from __future__ import annotations

import math
import random

import pytest

from kvbench.common.musique import Prompt
from kvbench.vllm.real import budget_path, first_difference, paired_difference, until_stop, warm_chunks


def test_outputs_are_cut_after_the_first_stop_token():
    assert until_stop([5, 6, 2, 7, 2], frozenset({2})) == [5, 6, 2]
    assert until_stop([5, 6], frozenset({2})) == [5, 6]


def test_first_difference_names_the_first_differing_token():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_warm_serves_a_records_passages_in_another_order_behind_the_next_records():
    prompts = [Prompt((0,), ((10 * i + 1,), (10 * i + 2,), (10 * i + 3,)), (99,)) for i in range(3)]
    rng = random.Random(0)
    for i in range(3):
        got = warm_chunks(prompts, i, rng)
        assert got[0] == [0] and got[1] == list(prompts[(i + 1) % 3].passages[0])
        own = [list(p) for p in prompts[i].passages]
        assert sorted(got[2:]) == own and got[2:] != own


def test_paired_difference_is_the_mean_difference_with_its_standard_error():
    mean, se = paired_difference([1.0, 0.5, 1.0, 0.0], [1.0, 1.0, 0.5, 0.0])
    assert mean == 0.0
    assert se == pytest.approx(math.sqrt((0.25 + 0.25) / 3 / 4))  # sd of (0, -.5, .5, 0) over sqrt(4)
    assert paired_difference([0.8, 0.6], [0.8, 0.6]) == (0.0, 0.0)
    assert paired_difference([0.5], [0.25]) == (0.25, 0.0)


def test_budget_path_names_each_run_of_equal_budgets_and_counts_the_sampled():
    got = budget_path([0.25, 0.25, 0.4, 0.4, 0.25], [True, True, False, True, False])
    assert got == {"runs": [[0, 0.25], [2, 0.4], [4, 0.25]], "requests_per_budget": {"0.25": 3, "0.4": 2},
                   "sampled": 3}
