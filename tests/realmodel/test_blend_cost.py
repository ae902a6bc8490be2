"""`kvcraft bench blend-cost` on the real model: the adapter as deployed serves exact reuse while
too little of the prompt is stored for a blend to pay, and blends at its Plan's budget once
enough is; exact reuse is full prefill's."""

from __future__ import annotations

import json

import pytest

from kvbench.engine import blend_cost

pytestmark = pytest.mark.timeout(600)


def test_as_deployed_the_prompt_is_served_by_exact_reuse_until_enough_is_stored(fetched, tmp_path):
    out = tmp_path / "cost.json"
    assert blend_cost.main(["--model", str(fetched.path), "--passages", "1", "--stored", "0", "1", "--repeats", "1",
                            "--warmup", "0", "--budgets", "0.25", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["stored_passages"] for r in rows] == [0, 1] and rows[0]["stored_share"] == 0
    for row in rows:
        cases = {c["case"]: c for c in row["cases"]}
        assert cases["exact reuse"]["logit_dev"] < 1e-4 and cases["exact reuse"]["computed_share"] < 1
        deployed = cases["as deployed"]
        assert row["deployed_budget"] == 0.25  # a fresh service's cold start
        like = cases["blend 25%"] if row["deployed_blended"] else cases["exact reuse"]  # the same rows computed
        assert deployed["computed_share"] == like["computed_share"]
        assert deployed["logit_dev"] == pytest.approx(like["logit_dev"], abs=1e-6)
    # The instruction alone stored: a blend would compute more than exact reuse. The passage too:
    # at 25% it computes under 70% of exact reuse's rows (a passage is most of the prompt).
    assert [r["deployed_blended"] for r in rows] == [False, True]
    assert rows[1]["cases"][-1]["logit_dev"] > 1e-4  # a blend, not exact reuse
