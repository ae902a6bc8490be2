"""The last layer of a pass runs its attention, o-proj and MLP for the last prompt row alone
(`loop._Loop.run`): every row's K/V is written there, and only the last row's hidden state is
read after it (the next token's logits). Against the same pass run for every row's logits
(`all_logits`, where every row runs the whole last layer): the same KV bit for bit, the same
rows computed, the last row's logits within float32 rounding of a matmul over other rows."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from engine_adapter.blend import blend_prefill
from engine_adapter.llama import LlamaConfig, LlamaEngine
from engine_adapter.policy import Policy
from engine_adapter.probe import TRUSTED
from engine_adapter.source import InMemoryLayerSource
from tests.engine_adapter.adapter_helpers import make_prompt

LAYERS = 4


def _blend(engine: LlamaEngine, policy: str, all_logits: bool) -> tuple[object, list[tuple[int, int]]]:
    """The prefill's result and (layer, rows) of each call of the model's layer output."""
    p = make_prompt(engine, seed=3, behind="other", chunk_len=24, n_chunks=4)
    source = InMemoryLayerSource({i: v.kv for i, v in p.cache.items()})
    options = {"ratio": 0.15} if policy == "cacheblend" else {}
    rows: list[tuple[int, int]] = []
    inner = engine.layer_out

    def layer_out(layer, h, o):  # noqa: ANN001, ANN202
        rows.append((layer, h.shape[0]))
        return inner(layer, h, o)

    with mock.patch.object(engine, "layer_out", layer_out):
        res = blend_prefill(engine, p.segments(), Policy(policy, **options), source, gate=TRUSTED, stats=False,
                            all_logits=all_logits)
    return res, rows


@pytest.mark.parametrize("policy", ["full", "cacheblend", "naive", "query"])
def test_the_last_layer_runs_the_last_row_alone_and_changes_no_kv(policy: str):
    cfg = dataclasses.replace(LlamaConfig.named("tiny"), num_layers=LAYERS)
    engine = LlamaEngine.random(cfg, seed=0, std=0.1)
    one, rows_one = _blend(engine, policy, all_logits=False)
    every, rows_every = _blend(engine, policy, all_logits=True)
    last_one = [n for layer, n in rows_one if layer == LAYERS - 1]
    last_every = [n for layer, n in rows_every if layer == LAYERS - 1]
    assert last_one[-1] == 1 and last_every[-1] > 1, (rows_one, rows_every)
    assert rows_one[:-1] == rows_every[:-1]  # every layer before the last runs the same rows
    assert one.computed_rows == every.computed_rows  # the policy's budget counts the rows whose K/V it computed
    for (k1, v1), (k2, v2) in zip(one.kv, every.kv, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    torch.testing.assert_close(one.logits, every.logits, rtol=1e-5, atol=1e-5 * every.logits.abs().max().item())
