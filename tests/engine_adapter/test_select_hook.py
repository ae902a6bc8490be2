"""The plug-in interface (`engine_adapter.selection`, docs/adapter.md "Policies as plug-ins"):
a pass and a choice of rows written outside the package run in the same layer step as every
policy's, and do what the interface documents, against plain-torch references."""

from __future__ import annotations

from typing import Sequence

import torch

from engine_adapter.loop import run_pass
from engine_adapter.prompt import Layout
from engine_adapter.selection import LayerView, Pass, Selection
from tests.engine_adapter.adapter_helpers import make_prompt, reference_shallow_rows, rel_dev


class StopAt(Selection):
    """At layer `at`, keep none of the candidates (the reused chunks' rows): they write their K/V
    there, then stop."""

    def __init__(self, at: int) -> None:
        self.at = at

    def choice(self, view: LayerView) -> int | None:
        return 0 if view.layer == self.at else None


class DropAfter(Selection):
    """After layer `at`, the reused chunks' rows stop."""

    def __init__(self, at: int) -> None:
        self.at = at

    def drop(self, view: LayerView) -> Sequence[int]:
        lay = view.layout
        return [r for s in view.live for r in range(*lay.edges[s:s + 2])] if view.layer == self.at else ()


def _run(engine, p, selection: Selection | None = None, every_row: bool = False):  # noqa: ANN001, ANN202
    lay = Layout.of(p.segments(), engine.model_spec().fingerprint())
    question = range(lay.edges[-2], lay.n)
    spec = Pass(tuple(range(len(p.chunks))), range(lay.n) if every_row else question, selection or Selection())
    return run_pass(engine, lay, spec, p.source(), 1.0)


def test_a_pass_that_computes_every_row_gives_full_prefill(engine):
    p = make_prompt(engine, seed=3, behind="other")
    logits, kv = engine.prefill(p.tokens, all_logits=False)
    got = _run(engine, p, every_row=True)
    assert rel_dev(got.logits, logits[-1]) < 1e-5
    for (k, v), (rk, rv) in zip(kv, got.kv):
        assert torch.allclose(k, rk, atol=1e-4) and torch.allclose(v, rv, atol=1e-4)
    assert rel_dev(_run(engine, p).logits, logits[-1]) > 1e-3  # naive reuse alone is not full prefill


def test_rows_a_choice_stops_inside_a_layer_write_that_layer_then_keep_the_stored_kv(engine):
    """Rows a choice keeps none of at layer 1 wrote their layer-1 K/V from full prefill's hidden
    states, so the question there reads what full prefill's reads: the same as every row
    through layers 0..1 then the question alone over the stored KV (plain torch)."""
    p = make_prompt(engine, seed=4, behind="other")
    got = _run(engine, p, StopAt(1), every_row=True)
    logits, kv = reference_shallow_rows(engine, p, depth=2)
    assert rel_dev(got.logits, logits) < 1e-5
    for (k, v), (rk, rv) in zip(kv, got.kv):
        assert torch.allclose(k, rk, atol=1e-4) and torch.allclose(v, rv, atol=1e-4)
    assert got.computed_rows[1] == len(p.question)  # the question alone attended at layer 1


def test_rows_a_selection_drops_after_a_layer_keep_the_stored_kv_from_the_next(engine):
    p = make_prompt(engine, seed=5, behind="other")
    got = _run(engine, p, DropAfter(0), every_row=True)
    logits, kv = reference_shallow_rows(engine, p, depth=1)
    assert rel_dev(got.logits, logits) < 1e-5
    for (k, v), (rk, rv) in zip(kv, got.kv):
        assert torch.allclose(k, rk, atol=1e-4) and torch.allclose(v, rv, atol=1e-4)
    assert got.computed_rows[:2] == [len(p.tokens), len(p.question)]
