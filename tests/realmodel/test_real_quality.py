"""kvbench.quality.real_quality on the real model: 2 dev records, full, naive and the default policy,
through a service.

Each prompt holds one passage (not the benchmark's 3) to keep the suite short; the
stream, the warm requests and the columns are the benchmark's own.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from engine_adapter.generate import greedy, stop_tokens
from engine_adapter.llama import LlamaEngine
from engine_adapter.policy import DEFAULT_POLICY
from kvbench.common import musique
from kvbench.quality import real_quality

NEW_TOKENS = 8
# the module fixture serves 2 records x 3 policies on the 30-layer model (after the session fetch)
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def records():
    return musique.load(passages=1, limit=2)


@pytest.fixture(scope="module")
def result(fetched, records):
    out = real_quality.run(fetched.path, records, ["full", "naive", DEFAULT_POLICY], new_tokens=NEW_TOKENS,
                           progress=False)
    return json.loads(json.dumps(out))  # what --json writes


def test_full_through_the_service_answers_as_the_plain_engine(fetched, records, result):
    engine = LlamaEngine.from_pretrained(fetched.path)
    p = musique.prompt(AutoTokenizer.from_pretrained(fetched.path), records[0])
    with torch.no_grad():
        logits, kv = engine.prefill(torch.tensor(p.tokens), all_logits=False)
    ref = greedy(engine, logits, kv, NEW_TOKENS, stop_tokens(fetched.path))
    assert result["records"][0]["served"]["full"]["tokens"] == list(ref.tokens)


def test_full_computes_every_row_layer_and_naive_reuses_the_passages(result):
    rows = {r["policy"]: r for r in result["policies"]}
    assert rows["full"]["computed_share"] == 1.0
    assert rows["naive"]["computed_share"] < 0.2
    assert rows["full"]["rouge_l_vs_full"] == rows["full"]["identical_to_full"] == 1.0
    for rec in result["records"]:
        assert rec["served"]["naive"]["computed_share"] < 0.2


def test_the_json_has_every_column_and_every_answer(result, records):
    assert [r["policy"] for r in result["policies"]] == ["full", "naive", DEFAULT_POLICY]
    for row in result["policies"]:
        assert set(real_quality.COLUMNS) <= set(row)
        assert row["records"] == len(records)
        assert row["ttft_s"] > 0 and row["speedup_vs_transformers"] > 0
    assert [r["id"] for r in result["records"]] == [r.id for r in records]
    for rec in result["records"]:
        assert rec["transformers_prefill_s"] > 0 and rec["prompt_tokens"] > 0
        for got in rec["served"].values():
            assert {"answer", "tokens", "ttft_s", *real_quality.COLUMNS} - {"speedup_vs_transformers"} <= set(got)
            assert 1 <= len(got["tokens"]) <= NEW_TOKENS
    assert result["meta"]["records"] == len(records) and result["meta"]["transformers"]
    assert "| naive |" in real_quality.table(result)


def test_the_default_policy_keeps_the_first_token_within_its_budget(result):
    """The real-model fidelity check of the default: its answer starts as full prefill's on
    every record, at most 15% of the row-layers of the reused chunks and the question
    computed (here nearly the whole prompt: one passage, no fresh chunk)."""
    for rec in result["records"]:
        got, full = rec["served"][DEFAULT_POLICY], rec["served"]["full"]
        assert got["tokens"][:1] == full["tokens"][:1]
        assert 0.03 < got["computed_share"] <= 0.15
