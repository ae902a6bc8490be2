"""kvbench.quality.real_bound on the real model: the oracles' scores against transformers' own
attention and against a passage stored exactly, and a repair of every passage row against
full prefill."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine_adapter.blend import prefill_with_picks, question_reads, run_passes
from engine_adapter.llama import LlamaEngine
from engine_adapter.policies.picks import QuestionReads, most_read
from engine_adapter.policy import Naive, Policy
from engine_adapter.source import InMemoryLayerSource
from kvbench.common import musique
from kvbench.quality import real_bound

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def case(fetched):
    tok = AutoTokenizer.from_pretrained(fetched.path)
    engine = LlamaEngine.from_pretrained(fetched.path)
    prompts = [musique.prompt(tok, r) for r in musique.load(passages=1, limit=2)]
    with torch.no_grad():
        s = real_bound.served(engine, prompts, 0)
        full = run_passes(engine, s.layout, Policy("full"), InMemoryLayerSource({}), [])
        naive = run_passes(engine, s.layout, Naive(), s.source(), [0, 1])
        scores = real_bound.oracle_scores(engine, s, full, naive)
    return engine, prompts[0], s, full, naive, scores


def test_reads_are_the_question_attention_of_transformers_full_prefill(fetched, case):
    engine, prompt, s, _, _, scores = case
    hf = AutoModelForCausalLM.from_pretrained(fetched.path, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        att = hf(torch.tensor([prompt.tokens]), output_attentions=True).attentions  # L x [1, H, N, N]
    question = s.layout.span(2)
    L = engine.cfg.num_layers
    want = sum(att[layer][0, :, question].sum((0, 1)) for layer in range(1, L - 1))
    torch.testing.assert_close(scores["reads"], want, rtol=1e-3, atol=1e-3)


def test_deviation_is_zero_outside_the_passage_and_for_a_passage_stored_exactly(case):
    engine, _, s, full, naive, scores = case
    passage = s.layout.span(1)
    assert scores["deviation"][: passage.start].abs().max() == 0 and scores["deviation"][passage.stop:].abs().max() == 0
    assert scores["deviation"][passage].min() > 0  # its variant was computed behind another passage
    exact = real_bound.Served(s.segments, s.layout, {0: s.stored[0], 1: full.fresh[1].kv})
    with torch.no_grad():
        reused_exact = run_passes(engine, s.layout, Naive(), exact.source(), [0, 1])
        none = real_bound.oracle_scores(engine, exact, full, reused_exact)
    assert none["deviation"].max() < 1e-4 * scores["deviation"].max()


def test_recomputing_every_passage_row_gives_full_prefill(case):
    engine, prompt, s, full, _, scores = case
    asked = question_reads(engine, s.layout, s.source(), [0, 1], layer_budget_s=1.0)
    q = QuestionReads(scores["deviation"], asked.live, asked.result, asked.layer0)
    picks = most_read(q, s.layout, s.layout.n, num_layers=engine.cfg.num_layers)
    assert picks.rows[1] == tuple(range(len(prompt.passages[0])))
    with torch.no_grad():
        got = prefill_with_picks(engine, s.layout, q, picks, s.source(), stats=False)
    torch.testing.assert_close(got.logits, full.logits, rtol=1e-4, atol=1e-4)
    assert got.logits.argmax() == full.logits.argmax()


def test_one_passage_encoded_behind_the_instruction_is_exact_reuse(case):
    # APE's shared prefix: with one passage, behind the instruction is where the prompt has it
    engine, prompt, s, full, naive, _ = case
    shared = real_bound.behind_instruction(engine, s, prompt)
    assert shared.segments[1].cached_prefix == (s.layout.keys[0],)
    with torch.no_grad():
        exact = run_passes(engine, shared.layout, Naive(), shared.source(), shared.reused)
    torch.testing.assert_close(exact.logits, full.logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(naive.logits, full.logits, rtol=1e-4, atol=1e-4)  # the stored variant is not


@pytest.mark.parametrize("argv", [["--budgets", "1.5"], ["--budgets", "0"], ["--prompts", "0"], ["--first", "-1"],
                                  ["--passages", "0"], ["--only", "5", "--prompts", "3"], ["--ape", "0,1"],
                                  ["--ape", "0.9"], ["--ape", "0.9,x"]])
def test_refuses_bad_arguments_before_loading_anything(argv, capsys):
    with pytest.raises(SystemExit) as e:
        real_bound.main(argv)
    assert e.value.code == 2
    assert "must" in capsys.readouterr().err


def test_each_case_reports_its_first_tokens_margin_over_the_runner_up(fetched, case):
    engine, prompt, *_ = case
    tok = AutoTokenizer.from_pretrained(fetched.path)
    prompts = [musique.prompt(tok, r) for r in musique.load(passages=1, limit=2)]
    with torch.no_grad():
        out = real_bound._record(engine, None, prompts, 0, budgets=[], new_tokens=1, stop=frozenset())
        hf = AutoModelForCausalLM.from_pretrained(fetched.path, dtype=torch.float32)
        last = hf(torch.tensor([prompt.tokens])).logits[0, -1]
    top = last.topk(2)
    assert out["full"]["margin"] == pytest.approx(float(top.values[0] - top.values[1]), abs=1e-3)
    assert out["full"]["tokens"][0] == int(top.indices[0])
    assert out["naive"]["margin"] != pytest.approx(out["full"]["margin"], abs=1e-3)  # naive reuse moves the logits
