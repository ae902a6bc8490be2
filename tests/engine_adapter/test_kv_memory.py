"""A prefill's memory: the KV it keeps (each layer's K and V, and not the layer's other heads),
and the rows its MLPs take at once.

A full prefill's K and V are views of the layer's QKV projection and of its rotated q and k
(`step.layer_step`); kept as views they would hold every query head's rows as well (for
SmolLM2, 9 query heads over 3 kv heads: five times the KV). The bytes a result holds are
compared with the KV's own size, computed from the model's shape."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .adapter_helpers import make_prompt
from engine_adapter.blend import blend_prefill
from engine_adapter.policy import Policy
from engine_adapter.probe import TRUSTED
from engine_adapter.prompt import Segment
from engine_adapter.source import InMemoryLayerSource


def held_bytes(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """The bytes of every storage the per-layer K/V keep alive (each storage once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for k, v in kv for t in (k, v)}
    return sum(storages.values())


def kv_bytes(engine, tokens: int) -> int:
    c = engine.cfg
    return 2 * c.num_layers * c.num_kv_heads * tokens * c.head_dim * torch.finfo(engine.dtype).bits // 8


def test_full_prefill_keeps_its_kv_and_nothing_more(engine):
    assert engine.cfg.num_heads > engine.cfg.num_kv_heads  # else a view of q and k could hide nothing
    tokens = torch.randint(0, engine.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    logits, kv = engine.prefill(tokens, all_logits=False)
    assert held_bytes(kv) == kv_bytes(engine, 40)
    alone, none = engine.prefill(tokens, all_logits=False, kv=False)
    assert none == [] and torch.equal(alone, logits)


def test_a_blend_that_computes_every_row_keeps_its_kv_and_nothing_more(engine):
    p = make_prompt(engine, 0)
    segments = [Segment(c) for c in p.chunks] + [Segment(p.question, question=True)]  # nothing stored: every row
    result = blend_prefill(engine, segments, Policy("full"), InMemoryLayerSource({}), gate=TRUSTED)
    n = len(p.tokens)
    assert held_bytes(result.kv) == kv_bytes(engine, n)
    ref, ref_kv = engine.prefill(p.tokens)
    assert all(torch.equal(k, rk) and torch.equal(v, rv) for (k, v), (rk, rv) in zip(result.kv, ref_kv))


class _MlpRows(TorchDispatchMode):
    """The most rows any matrix product of the MLP's width (gate and up together) was given."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width, self.rows = width, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and out.shape[-1] == self.width:
            self.rows = max(self.rows, out.shape[0])
        return out


def test_an_engines_token_budget_bounds_the_rows_each_mlp_takes(engine, monkeypatch):
    """A model with `max_rows` (vLLM's max_num_batched_tokens, `vllm.layers.VllmLayers`) runs
    each layer's o-proj and MLP on at most that many rows at once, as the engine's own chunked
    prefill would; the logits are full prefill's."""
    p = make_prompt(engine, 1)
    segments = [Segment(c) for c in p.chunks] + [Segment(p.question, question=True)]
    ref = engine.prefill(p.tokens, all_logits=False, kv=False)[0][-1]
    seen = {}
    for bound in (None, 16):
        monkeypatch.setattr(engine, "max_rows", bound)
        with _MlpRows(2 * engine.cfg.intermediate_size) as mlp:  # gate and up, one product
            got = blend_prefill(engine, segments, Policy("full"), InMemoryLayerSource({}), gate=TRUSTED)
        seen[bound] = mlp.rows
        torch.testing.assert_close(got.logits, ref, rtol=1e-5, atol=1e-5)
    assert seen == {None: len(p.tokens), 16: 16}
