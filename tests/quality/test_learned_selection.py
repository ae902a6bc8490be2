"""The default token selection keeps the trained model's answers at the default budget,
through the adapter's blended prefill, on 300 held-out prompts, in seconds. Fails if it
falls more than 3 points below what was measured.

The default: each stored variant's learned list (`engine_adapter.selection.fresh_gain`,
merged over two later requests that computed the chunk in full behind other prompts'
chunks and asked about it), one prompt-wide budget (`kvcraft.recompute.allocate`, the
planner's own function) of `DEFAULT_BUDGET` of the reused tokens.

What takes minutes is learning the lists (two gains per chunk, 3600 of them), so they
are a committed fixture (`gains-seed1.pt`, written by `python -m kvbench.quality.selection
--examples 300 --seed 1 --save-gains ...`); `test_the_fixture_is_what_the_engine_learns`
learns them again for the first prompts and holds the fixture to them, so a change in how
lists are learned fails there, and a change in how they are spent or blended fails the
accuracy test. The stored variants and every blended prefill run here (batched: seconds).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_adapter import LlamaEngine, Policy
from engine_adapter.selection import DEFAULT_BUDGET
from kvbench.quality import modeling, selection

N_EXAMPLES = 300  # held-out draw 1, no choice was made on it
GAINS = Path(__file__).with_name("gains-seed1.pt")
# measured with this module's fixture, 2026-11-24, the 2-core CPU VM: full 99.3%, naive
# 28.7%, learned 97.3% (cross 97.2%, local 97.6%) at 14.1% of the reused token-layers
MEASURED = {"full": 0.993, "learned": 0.973}
RELEARN = 12  # prompts whose lists the fixture check learns again

pytestmark = pytest.mark.skipif(not (modeling.MODEL_DIR / "model.safetensors").exists(),
                                reason=f"no trained model committed under {modeling.MODEL_DIR}")


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return LlamaEngine.from_pretrained(modeling.MODEL_DIR)


@pytest.fixture(scope="module")
def scores(engine):
    with torch.no_grad():
        ps = selection.prompts(engine, N_EXAMPLES, seed=1, stats=False)
        selection.load_gains(ps, GAINS)
        return {"full": selection.score(engine, ps, Policy("full")),
                "naive": selection.score(engine, ps, Policy("naive")),
                "learned": selection.score(engine, ps, Policy("cachecraft"),
                                           selection.learned(DEFAULT_BUDGET, "gain"))}


def test_the_fixture_is_what_the_engine_learns(engine):
    with torch.no_grad():
        learned = selection.prompts(engine, RELEARN, seed=1, observe=2, stats=False)
    saved = selection.prompts(engine, RELEARN, seed=1, stats=False)
    selection.load_gains(saved, GAINS)
    for a, b in zip(learned, saved):
        for j in a.gains:
            assert torch.allclose(a.gains[j], b.gains[j], rtol=1e-3, atol=1e-4), (j, a.gains[j], b.gains[j])
    assert sum(float(g.max()) > 1.0 for p in learned for g in p.gains.values()) >= RELEARN  # lists are not empty


def test_the_default_keeps_the_measured_accuracy_at_the_default_budget(scores):
    assert scores["learned"]["acc_all"] >= MEASURED["learned"] - 0.03, scores
    assert scores["learned"]["acc_cross"] >= scores["naive"]["acc_cross"] + 0.5, scores


def test_the_default_recomputes_at_most_its_budget(scores):
    assert 0 < scores["learned"]["recomputed_share"] <= DEFAULT_BUDGET + 1e-9, scores
    assert scores["learned"]["recomputed_selective"] == scores["learned"]["recomputed_share"], scores


def test_full_prefill_is_where_it_was_measured(scores):
    assert scores["full"]["acc_all"] >= MEASURED["full"] - 0.03, scores
