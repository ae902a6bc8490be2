"""The default token selection keeps the trained models' answers at the default budget,
through the adapter's blended prefill, on held-out prompts of both quality tasks (300
short, 100 long), in seconds. Fails if it falls more than 3 points below what was measured.

The default: each stored variant's learned list (`engine_adapter.learned.learn`: the
greedy recompute gain, merged over two later requests that computed the chunk in full
behind other prompts' chunks and asked about it), one prompt-wide budget
(`kvcraft.recompute.allocate`, the planner's own function) of `DEFAULT_BUDGET` of the
reused tokens.

What takes minutes is learning the lists (a fresh gain and greedy rounds per chunk and
request, thousands of them), so they are committed fixtures (`lists-seed1.pt`,
`lists-long-seed1.pt`, written by `kvcraft bench selection [--task long] --examples N
--seed 1 --only default --save-lists ...` in the held-out runs of docs/quality.md);
`test_the_fixture_is_what_the_engine_learns` learns them again for the first prompts and
holds the fixture to them, so a change in how lists are learned fails there, and a change
in how they are spent or blended fails the accuracy test. The stored variants and every
blended prefill run here (batched: seconds).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_adapter import LlamaEngine, Policy
from kvcraft.recompute import DEFAULT_BUDGET
from kvbench.quality import modeling, selection

HERE = Path(__file__).parent

# Per task: committed model, held-out prompts of draw 1 (no choice was made on it), the
# fixture of their learned lists, prompts the fixture check learns again, and what was
# measured with the fixture (2026-11-24, the 2-core CPU VM; docs/quality.md).
TASKS = {
    # short: full 99.3%, default 97.7% (cross 97.7%, local 97.6%) at 14.1% of the reused token-layers
    "short": dict(model=modeling.MODEL_DIR, n=300, lists="lists-seed1.pt", relearn=12,
                  measured={"full": 0.993, "learned": 0.977}),
    # long: the first 100 prompts of its held-out draw 1 (the fixture holds 200): full 96.0%,
    # naive 24.0%, default 94.0% (cross 92.3%, local 100%) at 10.7% of the reused token-layers
    "long": dict(model=modeling.LONG_MODEL_DIR, n=100, lists="lists-long-seed1.pt", relearn=4,
                 measured={"full": 0.960, "learned": 0.940}),
}

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not all((t["model"] / "model.safetensors").exists() for t in TASKS.values()),
                                 reason="no trained model committed under bench/quality/")]


@pytest.fixture(scope="module", params=sorted(TASKS))
def task(request):
    return request.param


@pytest.fixture(scope="module")
def engine(task):
    torch.set_num_threads(1)
    return LlamaEngine.from_pretrained(TASKS[task]["model"])


@pytest.fixture(scope="module")
def scores(task, engine):
    t = TASKS[task]
    with torch.no_grad():
        ps = selection.prompts(engine, t["n"], seed=1, stats=False, task=task)
        selection.load_lists(ps, HERE / t["lists"])
        return {"full": selection.score(engine, ps, Policy("full")),
                "naive": selection.score(engine, ps, Policy("naive")),
                "learned": selection.score(engine, ps, Policy("cachecraft"),
                                           selection.learned(DEFAULT_BUDGET, "default")),
                "measured": t["measured"]}


def test_the_fixture_is_what_the_engine_learns(task, engine):
    t = TASKS[task]
    with torch.no_grad():
        learned = selection.prompts(engine, t["relearn"], seed=1, observe=2, stats=False, task=task)
    saved = selection.prompts(engine, t["relearn"], seed=1, stats=False, task=task)
    selection.load_lists(saved, HERE / t["lists"])
    for a, b in zip(learned, saved):
        for j in a.lists:
            x, y = a.lists[j], b.lists[j]
            # the same scores; where two candidates tie up to rounding, the greedy may take
            # either (batches differ), so positions are held only for scores that matter
            assert torch.allclose(x.sort().values, y.sort().values, rtol=1e-3, atol=1e-4), (j, x, y)
            assert torch.equal(x > 0.1, y > 0.1), (j, x, y)
    assert sum(float(g.max()) > 1.0 for p in learned for g in p.lists.values()) >= t["relearn"]  # not empty


def test_the_default_keeps_the_measured_accuracy_at_the_default_budget(scores):
    assert scores["learned"]["acc_all"] >= scores["measured"]["learned"] - 0.03, scores
    assert scores["learned"]["acc_cross"] >= scores["naive"]["acc_cross"] + 0.5, scores


def test_the_default_recomputes_at_most_its_budget(scores):
    assert 0 < scores["learned"]["recomputed_share"] <= DEFAULT_BUDGET + 1e-9, scores
    assert scores["learned"]["recomputed_selective"] == scores["learned"]["recomputed_share"], scores


def test_full_prefill_is_where_it_was_measured(scores):
    assert scores["full"]["acc_all"] >= scores["measured"]["full"] - 0.03, scores
