"""The default token selection (a learned per-variant list, `engine_adapter.selection`)
keeps the trained model's answers at a small recompute budget, through the adapter's
blended prefill. Fails if it falls more than 3 points below what was measured.

Each stored variant is computed behind a chunk of another prompt; its list is learned
from a second request that computed the same chunk in full behind a third prompt's
chunk and asked about it (`kvbench.quality.selection.prompts(observe=True)`).
"""

from __future__ import annotations

import pytest
import torch

from engine_adapter import LlamaEngine, Policy
from engine_adapter.selection import DEFAULT_BUDGET
from kvbench.quality import modeling, selection

N_EXAMPLES = 200  # held-out draw 1; 230 s on the shared 2-core VM under load 10, mostly the 2400 chunk prefills
# measured with this module's fixture (full 99.5%, naive 29.5%, learned 95.0% at 14.1% recomputed)
MEASURED = {"full": 0.995, "learned": 0.950}  # 2026-11-23, the 2-core CPU VM

pytestmark = pytest.mark.skipif(not (modeling.MODEL_DIR / "model.safetensors").exists(),
                                reason=f"no trained model committed under {modeling.MODEL_DIR}")


@pytest.fixture(scope="module")
def scores():
    torch.set_num_threads(1)
    engine = LlamaEngine.from_pretrained(modeling.MODEL_DIR)
    ps = selection.prompts(engine, N_EXAMPLES, seed=1, observe=True, stats=False)
    return {"full": selection.score(engine, ps, Policy("full")),
            "naive": selection.score(engine, ps, Policy("naive")),
            "learned": selection.score(engine, ps, Policy("cachecraft"), selection.learned(DEFAULT_BUDGET))}


def test_learned_lists_keep_the_measured_accuracy_at_the_default_budget(scores):
    assert scores["learned"]["acc_all"] >= MEASURED["learned"] - 0.03, scores
    assert scores["learned"]["acc_cross"] >= scores["naive"]["acc_cross"] + 0.5, scores


def test_learned_lists_recompute_at_most_the_budget(scores):
    assert 0 < scores["learned"]["recomputed_share"] <= DEFAULT_BUDGET + 1e-9, scores
    assert scores["learned"]["recomputed_selective"] == scores["learned"]["recomputed_share"], scores


def test_full_prefill_is_where_it_was_measured(scores):
    assert scores["full"]["acc_all"] >= MEASURED["full"] - 0.03, scores
