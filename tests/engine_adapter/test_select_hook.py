"""The loop's one hook (`driver.Selection`, docs/adapter.md "The select hook"): a choice of
rows written outside the driver runs in the same layer step as every policy's, and does what
the hook documents, against plain-torch references."""

from __future__ import annotations

import torch

from engine_adapter.driver import Selection, run_blend
from engine_adapter.policy import Naive
from engine_adapter.prompt import Layout
from tests.engine_adapter.adapter_helpers import make_prompt, reference_shallow_rows, rel_dev


class EveryRow(Selection):
    """`first`: every prompt row runs from layer 0."""

    def first(self, b, rows):  # noqa: ANN001, ANN201
        return list(range(b.n))


class QuestionAfter(Selection):
    """Every row from layer 0; from layer `at`, `select` keeps the rows outside the reused
    chunks (the question): the chunks' rows write their K/V at `at`, then stop."""

    def __init__(self, at: int) -> None:
        self.at = at

    def first(self, b, rows):  # noqa: ANN001, ANN201
        return list(range(b.n))

    def acts(self, b, layer):  # noqa: ANN001, ANN201
        return layer == self.at

    def select(self, b, layer, p, K, V):  # noqa: ANN001, ANN201
        host = b.host_rows(p)
        keep = [i for i, r in enumerate(host) if not b.reused_host[r]]
        return b.rows_of([host[i] for i in keep]), torch.tensor(keep, dtype=torch.long)


def _run(engine, p, selections=None):  # noqa: ANN001, ANN202
    lay = Layout.of(p.segments(), engine.model_spec().fingerprint())
    return run_blend(engine, lay, Naive(), p.source(), range(len(p.chunks)), selections=selections)


def test_a_selection_that_recomputes_every_row_gives_full_prefill(engine):
    p = make_prompt(engine, seed=3, behind="other")
    logits, kv = engine.prefill(p.tokens, all_logits=False)
    got = _run(engine, p, [EveryRow()])
    assert rel_dev(got.logits, logits[-1]) < 1e-5
    for (k, v), (rk, rv) in zip(kv, got.kv):
        assert torch.allclose(k, rk, atol=1e-4) and torch.allclose(v, rv, atol=1e-4)
    assert rel_dev(_run(engine, p).logits, logits[-1]) > 1e-3  # naive reuse alone is not full prefill


def test_rows_a_selection_stops_inside_a_layer_write_that_layer_then_keep_the_stored_kv(engine):
    """Rows stopped by `select` at layer 1 wrote their layer-1 K/V from full prefill's hidden
    states, so the question there reads what full prefill's reads: the same as every row
    through layers 0..1 then the question alone over the stored KV (plain torch)."""
    p = make_prompt(engine, seed=4, behind="other")
    got = _run(engine, p, [QuestionAfter(1)])
    logits, kv = reference_shallow_rows(engine, p, depth=2)
    assert rel_dev(got.logits, logits) < 1e-5
    for (k, v), (rk, rv) in zip(kv, got.kv):
        assert torch.allclose(k, rk, atol=1e-4) and torch.allclose(v, rv, atol=1e-4)
    assert got.computed_rows[1] == len(p.question)  # the question alone attended at layer 1
