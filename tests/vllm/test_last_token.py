"""Which step a finished blend's last prompt token answers (`engine_adapter.vllm.last_token`):
only a step whose tokens are exactly the named requests' last tokens, each matched to its own
request's hidden state whatever the step's order, once. (The path end to end, inside vLLM:
tests/vllm/test_blend.py, `full` through it gives vLLM alone's outputs and vLLM computes no
token; the scheduler side's naming: tests/vllm/test_blend_bench.py's reports.)"""

from __future__ import annotations

import torch

from engine_adapter.vllm.last_token import LastToken, LastTokens

LAYERS, HEADS, DIM, HIDDEN = 3, 2, 4, 8


def last(prompt: list[int], seed: int) -> LastToken:
    g = torch.Generator().manual_seed(seed)
    n = len(prompt)
    kv = [(torch.randn(HEADS, n, DIM, generator=g), torch.randn(HEADS, n, DIM, generator=g)) for _ in range(LAYERS)]
    return LastToken.of(prompt, kv, torch.randn(HIDDEN, generator=g))


def step(*places: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, positions) of a step of one token per (position, token)."""
    return torch.tensor([t for _, t in places]), torch.tensor([p for p, _ in places])


def test_a_last_token_is_the_prompts_last_row_of_every_layer():
    prompt = [5, 6, 7, 8]
    g = torch.Generator().manual_seed(1)
    kv = [(torch.randn(HEADS, 4, DIM, generator=g), torch.randn(HEADS, 4, DIM, generator=g)) for _ in range(LAYERS)]
    x = LastToken.of(prompt, kv, torch.zeros(HIDDEN))
    assert (x.position, x.token) == (3, 8)
    for layer, (k, v) in enumerate(kv):
        assert torch.equal(x.k[layer], k[:, 3]) and torch.equal(x.v[layer], v[:, 3])


def test_a_step_of_the_named_last_tokens_gets_each_requests_own_in_its_token_order_once():
    lasts = LastTokens()
    a, b = last([1, 2, 3], seed=2), last([4, 5, 6, 7, 9], seed=3)
    lasts.add("a", a)
    lasts.add("b", b)
    assert lasts.take_ready() == {"a", "b"} and lasts.take_ready() == set()
    ids, pos = step((4, 9), (2, 3))  # b's token first
    got = lasts.take(["a", "b"], ids, pos)
    assert isinstance(got, list) and [x is y for x, y in zip(got, (b, a))] == [True, True]
    assert isinstance(lasts.take(["a", "b"], ids, pos), str)  # answered once


def test_a_step_of_anything_else_is_left_to_vllm():
    lasts = LastTokens()
    lasts.add("a", last([1, 2, 3], seed=4))
    lasts.add("b", last([1, 2, 3], seed=5))  # alike in position and token
    lasts.add("c", last([7, 8], seed=6))
    assert isinstance(lasts.take(["a", "b"], *step((2, 3), (2, 3))), str)  # whose hidden state is whose: unknown
    assert isinstance(lasts.take(["c", "d"], *step((1, 8), (5, 5))), str)  # d holds none
    assert isinstance(lasts.take(["c"], *step((1, 9))), str)  # not the token the blend computed
    assert isinstance(lasts.take(["c"], *step((1, 8), (1, 8))), str)  # more tokens than requests
    lasts.drop({"c"})  # its request finished
    assert isinstance(lasts.take(["c"], *step((1, 8))), str)
    assert isinstance(lasts.take(["a"], *step((2, 3))), list)  # still held, alone in a step
