"""kvbench.quality.real_bound without the model: the summary's standard errors and paired differences."""

from __future__ import annotations

import statistics

import pytest

from kvbench.quality import real_bound
from kvbench.report.quality import ape, musique_table, oracle


def test_the_summary_pairs_each_case_with_the_default_record_by_record():
    rouge = {"full": [1.0, 1.0, 1.0], "query (default)": [0.5, 0.9, 0.7], "deviation 15%": [0.6, 0.8, 1.0]}
    records = [{"served": {label: {"rouge_l_vs_full": got[i], "identical_to_full": 0.0, "first_token_agrees": 1.0,
                                   "answer_forced_agrees": got[i] / 2, "f1": 0.0, "computed_share": 0.15}
                           for label, got in rouge.items()}}
               for i in range(3)]
    rows = {r["case"]: r for r in real_bound.summarize(records)}
    dev = rows["deviation 15%"]
    assert dev["rouge_l_vs_full"] == pytest.approx(0.8)
    assert dev["rouge_l_se"] == pytest.approx(statistics.stdev([0.6, 0.8, 1.0]) / 3 ** 0.5)
    assert dev["rouge_l_vs_default"] == pytest.approx(0.1)
    assert dev["rouge_l_vs_default_se"] == pytest.approx(statistics.stdev([0.1, -0.1, 0.3]) / 3 ** 0.5)
    assert rows["query (default)"]["rouge_l_vs_default"] == 0.0
    assert dev["first_token_se"] == 0.0 and dev["records"] == 3
    assert dev["answer_forced_agrees"] == pytest.approx(0.4)
    printed = musique_table({"cases": list(rows.values())})
    assert "| deviation 15% | 0.800 | 0.115 | +0.100 (0.115) | 0% | 100% | 0% | 40% | 3 |" in printed


def test_the_oracle_table_puts_each_budget_of_each_run_on_a_row_and_counts_where_greedy_picked():
    def case(name, first, se, rouge, share):
        return {"case": name, "first_token_agrees": first, "first_token_se": se, "rouge_l_vs_full": rouge,
                "computed_share": share}

    cases = [case("naive", 0.5, 0.1, 0.7, 0.02) | {"answer_forced_agrees": 0.625}, case("query (default)", 0.9, 0.05, 0.8, 0.15),
             *(case(f"{s} 15%", 0.75, 0.1, 0.75, 0.15) for s in ("deviation", "reads", "free question pass")),
             case("greedy 15%", 1.0, 0.0, 0.9, 0.13)]
    # one passage of 200 rows, 100..299: its first 64 are 100..163, its last 64 236..299
    picks = list(range(100, 110)) + list(range(170, 220)) + list(range(250, 290))
    run = {"command": "kvcraft bench real-bound --passages 5 --greedy", "date": "2026-12-03", "machine": {},
           "meta": {"records": 1}, "cases": cases,
           "records": [{"served": {"greedy 15%": {"computed_share": 0.13, "rows": picks, "edges": [0, 100, 300, 320]}}}]}
    printed = oracle([("x.json", run)])
    assert "| 5 (1) | 15% | 75% (10%) · 0.75 | 75% (10%) · 0.75 | 75% (10%) · 0.75 | 100% (0%) · 0.90 | 13.0% |" in printed
    assert "naive reuse 50% (10%) · 0.70 · 62% at 2.0% computed, the default 90% (5%) · 0.80 at 15.0%" in printed
    # of 100 picks: 10 in the first 64 rows (32% of 200), 40 in the last 64, 50 between (72 rows, 36%)
    assert ("10% in its first 64 rows (32% of the rows), 40% in its last 64 rows (32% of the rows), "
            "50% elsewhere (36% of the rows)") in printed


def test_the_oracle_table_names_the_records_each_run_measured():
    def run(ids):
        cases = [{"case": name, "first_token_agrees": 1.0, "first_token_se": 0.0, "rouge_l_vs_full": 1.0,
                  "computed_share": 0.05} for name in ("naive", "query (default)", "greedy 5%")]
        return {"command": "kvcraft bench real-bound --passages 10 --greedy", "date": "2026-12-04", "machine": {},
                "meta": {"records": len(ids)}, "cases": cases, "records": [{"id": i, "served": {}} for i in ids]}

    printed = oracle([("a.json", run([72, 73, 74])), ("b.json", run([89, 90, 106]))])
    assert "| 10 (3: 72-74) | 5% |" in printed
    assert "| 10 (3: 89, 90, 106) | 5% |" in printed
    assert "10 passages, records 89, 90, 106: naive reuse" in printed


def test_a_margin_gate_computes_again_the_records_whose_own_first_token_is_a_near_tie():
    from kvbench.report.quality import gated, margin_gate

    def rec(i, full_margin, agrees, margin):
        return {"id": i, "served": {"full": {"first_token_agrees": 1.0, "margin": full_margin, "computed_share": 1.0},
                                    "naive": {"first_token_agrees": agrees, "margin": margin,
                                              "computed_share": 0.01}}}

    # lost where naive reuse is unsure (0.2), kept where sure (3.0) and once where unsure (0.4)
    recs = [rec(0, 0.1, 0.0, 0.2), rec(1, 3.0, 1.0, 3.0), rec(2, 0.3, 1.0, 0.4), rec(3, 2.5, 1.0, 2.0)]
    assert gated(recs, "naive", 0.0) == (0.75, 0.0, 0.01)
    agree, again, computed = gated(recs, "naive", 1.0)  # records 0 and 2 computed again
    assert (agree, again) == (1.0, 0.5) and computed == pytest.approx(0.51)
    assert gated(recs, "naive", 2.0)[1] == 0.5  # a margin of exactly 2.0 passes a gate at 2
    run = {"command": "kvcraft bench real-bound --passages 10", "date": "2026-12-04", "machine": {},
           "meta": {"records": 4}, "records": recs}
    printed = margin_gate([("m.json", run)])
    assert "| naive (4: 0-3) | 75% · 1.0% | 100% · 50% · 51.0% |" in printed
    assert ("margin 2.50 (median) where every case kept the first token (3 records), 0.10 where one lost it (1;"
            in printed)


def test_the_ape_table_puts_each_run_in_a_column_and_leaves_a_case_a_run_lacks_empty():
    def case(name, first, share):
        return {"case": name, "first_token_agrees": first, "first_token_se": 0.1, "rouge_l_vs_full": 0.5,
                "answer_forced_agrees": 0.75, "computed_share": share}

    runs = [(f"{p}.json", {"command": f"kvcraft bench real-bound --passages {p} --ape 0.9,1", "date": "2026-12-03",
                           "machine": {}, "meta": {"records": n},
                           "cases": [case("full", 1.0, 1.0), case("naive", 0.5, 0.02)] +
                                    ([case("ape T=0.9 S=1", 0.25, 0.01)] if p == 3 else [])})
            for p, n in ((3, 24), (10, 6))]
    printed = ape(runs)
    assert "| case | 3 passages (24) | 10 passages (6) |" in printed
    assert "| naive | 50% (10%) · 0.50 · 75% at 2.0% | 50% (10%) · 0.50 · 75% at 2.0% |" in printed
    assert "| ape T=0.9 S=1 | 25% (10%) · 0.50 · 75% at 1.0% |  |" in printed
    assert "| full |" not in printed


def test_teacher_forcing_scores_the_share_of_full_prefills_answer_each_case_predicts():
    from kvbench.common import musique

    record = musique.Record(id=0, question="q", answers=("a",), passages=())
    served = {"full": {"tokens": [5, 6, 7, 8], "forced": [5, 6, 7, 8], "answer": "a b"},
              "naive": {"tokens": [5, 9, 9, 9], "forced": [5, 9, 7, 1], "answer": "a c"}}
    got = real_bound._score(record, served)["served"]
    assert got["naive"]["answer_forced_agrees"] == 0.5 and got["full"]["answer_forced_agrees"] == 1.0
    assert got["naive"]["identical_to_full"] == 0.0 and got["naive"]["first_token_agrees"] == 1.0


def test_greedy_adds_the_block_best_with_those_before_not_the_best_alone():
    """A worked example: B alone beats C alone, but C joined to A beats B joined to A."""
    a, b, c = [0, 1], [2], [3]
    kl = {(): 10.0, (0, 1): 4.0, (2,): 5.0, (3,): 6.0, (0, 1, 2): 3.9, (0, 1, 3): 1.0, (2, 3): 2.0, (0, 1, 2, 3): 0.5}
    asked = []

    def measured(rows):
        asked.append(tuple(rows))
        return kl[tuple(rows)]

    assert real_bound.greedy_blocks(measured, [a, b, c], rows=3) == [a, c]
    assert asked == [(0, 1), (2,), (3,), (0, 1, 2), (0, 1, 3)]  # every block that fits, against those added
    assert real_bound.greedy_blocks(lambda rows: kl[tuple(rows)], [a, b, c], rows=1) == [b]  # A never fits


def test_recomputing_every_block_of_the_passages_gives_full_prefill():
    import torch

    from engine_adapter.blend import question_reads
    from engine_adapter.llama import LlamaEngine
    from engine_adapter.prompt import Layout
    from tests.engine_adapter.adapter_helpers import make_prompt

    engine = LlamaEngine.random("tiny", seed=0, std=0.1)
    p = make_prompt(engine, 0, chunk_len=20)
    segments = p.segments()
    s = real_bound.Served(segments, Layout.of(segments, engine.model_spec().fingerprint()),
                          {i: v.kv for i, v in p.cache.items()})
    asked = question_reads(engine, s.layout, s.source(), s.reused, layer_budget_s=1.0)
    blocks = real_bound.passage_blocks(asked, s.layout, size=8)
    assert [len(b) for b in blocks] == [8, 8, 4] * 4  # each chunk's 20 rows, in runs of 8
    rows = sorted(r for b in blocks for r in b)
    assert rows == list(range(80))
    full = engine.prefill(p.tokens, all_logits=False, kv=False)[0][-1]
    naive = real_bound.with_rows(engine, s, asked, []).logits
    got = real_bound.with_rows(engine, s, asked, rows)
    assert sum(got.computed_rows) >= 80 * engine.cfg.num_layers
    torch.testing.assert_close(got.logits, full, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(naive, full, rtol=1e-4, atol=1e-4)  # the stored KV alone is not full prefill's
