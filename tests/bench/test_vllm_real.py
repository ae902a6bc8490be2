"""kvbench.vllm_real's pure parts: output comparison and the warm pass's chunk order."""

from __future__ import annotations

import random

from kvbench.musique import Prompt
from kvbench.vllm_real import first_difference, until_stop, warm_chunks


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
