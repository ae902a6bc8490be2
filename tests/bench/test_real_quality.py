"""kvbench.quality.real_quality without the model: policy specs, the warm request, the summary."""

from __future__ import annotations

import statistics

import pytest

from engine_adapter.policy import CacheBlend, CacheCraft, Full, QueryAware
from kvbench.common import musique
from kvbench.quality import real_quality
from kvbench.quality.real_quality import parse_policy, policy_specs


def test_specs_name_a_policy_and_its_options():
    assert parse_policy("full").policy == Full()
    assert parse_policy("cacheblend:budget=0.15").policy == CacheBlend(budget=0.15)
    assert parse_policy("cachecraft:focus_window=2").policy == CacheCraft(focus_window=2)
    assert parse_policy("cacheblend:ratio=0.1, filter_layers=2").policy == CacheBlend(ratio=0.1, filter_layers=2)
    assert parse_policy("query:heads=1,budget=0.2").policy == QueryAware(heads=1, budget=0.2)
    for spec in real_quality.DEFAULT_POLICIES:
        assert parse_policy(spec).spec == spec


@pytest.mark.parametrize("spec, says", [
    ("nope", "unknown policy 'nope'"),
    ("cacheblend:", "is not key=value"),
    ("cacheblend:budget", "is not key=value"),
    ("cacheblend:=0.1", "is not key=value"),
    ("cacheblend:budget=x", "needs a number, got 'x'"),
    ("cacheblend:budget=0.1,budget=0.2", "given twice"),
    ("naive:budget=0.1", "has no option(s) ['budget']"),
    ("cacheblend:budget=2", "outside (0, 1]"),
    ("cacheblend:ratio=0.1,budget=0.1", "a ratio or a budget, not both"),
    ("query:heads=2", "heads must be 0 or 1"),
    ("query:head_layers=0", "head_layers 0 outside (0, 1]"),
    ("query:head_layers=1.5", "head_layers 1.5 outside (0, 1]"),
])
def test_bad_specs_are_refused_with_the_reason(spec, says):
    with pytest.raises(ValueError) as e:
        parse_policy(spec)
    assert says in str(e.value) and repr(spec) in str(e.value)


def test_full_is_always_run_first_and_a_repeated_spec_is_refused():
    assert [p.spec for p in policy_specs(["naive", "cachecraft"])] == ["full", "naive", "cachecraft"]
    assert [p.spec for p in policy_specs(["naive", "full"])] == ["full", "naive"]
    with pytest.raises(ValueError, match="twice"):
        policy_specs(["naive", "naive"])


def test_the_command_line_refuses_a_bad_spec(capsys):
    with pytest.raises(SystemExit) as e:
        real_quality.main(["--policy", "full", "cacheblend:budget=x"])
    assert e.value.code == 2
    assert "needs a number" in capsys.readouterr().err


def _prompt(tag: int) -> musique.Prompt:
    return musique.Prompt((1, 2), ((tag, 10), (tag, 11), (tag, 12)), (tag, 99))


def test_a_warm_request_puts_the_passages_reversed_behind_a_neighbours_passage():
    prompts = [_prompt(t) for t in (100, 200, 300)]
    assert real_quality.warm_chunks(prompts, 1) == [(1, 2), (100, 10), (200, 12), (200, 11), (200, 10)]
    assert real_quality.warm_chunks(prompts, 0)[1] == (200, 10)  # the first: the next record's
    assert real_quality.warm_chunks(prompts[:1], 0) == [(1, 2), (100, 12), (100, 11), (100, 10)]


def test_the_summary_compares_with_full_and_times_against_transformers():
    def served(answer, tokens, ttft, share):
        return {"answer": answer, "tokens": tokens, "ttft_s": ttft, "computed_share": share, "fallbacks": 0}

    record = musique.Record(0, "q?", ("Exeter College",), ("p",))
    rec = real_quality._score(record, 100, 2.0, {"full": served("Exeter College", [5, 6], 2.0, 1.0),
                                                  "naive": served("Oxford", [7], 0.5, 0.1)})
    rows = {r["policy"]: r for r in real_quality.summarize([rec], ["full", "naive"])}
    assert rows["full"]["f1"] == rows["full"]["exact_match"] == rows["full"]["identical_to_full"] == 1.0
    assert rows["naive"]["f1"] == rows["naive"]["rouge_l_vs_full"] == rows["naive"]["first_token_agrees"] == 0.0
    assert rows["naive"]["speedup_vs_transformers"] == pytest.approx(4.0)
    assert rows["full"]["speedup_vs_transformers"] == pytest.approx(1.0)


def test_the_summary_gives_rouge_ls_standard_error_and_the_paired_difference_from_the_default():
    from engine_adapter.policy import DEFAULT_POLICY

    record = musique.Record(0, "q?", ("Paris",), ("p",))
    answers = {"full": ["a b c d", "a b", "x y z"], DEFAULT_POLICY: ["a b c d", "a q", "x y q"],
               "naive": ["a b q q", "q q", "x y z"]}
    recs = [real_quality._score(record, 50, 1.0, {label: {"answer": got[i], "tokens": got[i].split(), "ttft_s": 1.0,
                                                          "computed_share": 0.2, "fallbacks": 0}
                                                  for label, got in answers.items()})
            for i in range(3)]
    rows = {r["policy"]: r for r in real_quality.summarize(recs, list(answers))}
    rouge = {label: [musique.rouge_l(a, f) for a, f in zip(got, answers["full"])] for label, got in answers.items()}
    naive, default = rouge["naive"], rouge[DEFAULT_POLICY]
    assert rows["naive"]["rouge_l_se"] == pytest.approx(statistics.stdev(naive) / 3 ** 0.5)
    diff = [n - d for n, d in zip(naive, default)]
    assert rows["naive"]["rouge_l_vs_default"] == pytest.approx(sum(diff) / 3)
    assert rows["naive"]["rouge_l_vs_default_se"] == pytest.approx(statistics.stdev(diff) / 3 ** 0.5)
    assert rows["full"]["rouge_l_se"] == 0.0 and "rouge_l_vs_default" not in rows[DEFAULT_POLICY]
    text = real_quality.table({"meta": {}, "policies": list(rows.values()), "records": recs})
    mean, se = sum(diff) / 3, statistics.stdev(diff) / 3 ** 0.5
    assert f"| {statistics.fmean(naive):.3f} | {statistics.stdev(naive) / 3 ** 0.5:.3f} | {mean:+.3f} ({se:.3f}) |" in text


def test_table_and_plot_show_every_policy(tmp_path):
    record = musique.Record(0, "q?", ("Paris",), ("p",))
    served = {label: {"answer": "Paris", "tokens": [3], "ttft_s": 1.0, "computed_share": share, "fallbacks": 0}
              for label, share in (("full", 1.0), ("cacheblend:budget=0.15", 0.2))}
    recs = [real_quality._score(record, 50, 1.5, served)]
    result = {"meta": {"records": 1}, "policies": real_quality.summarize(recs, list(served)), "records": recs}
    text = real_quality.table(result)
    assert all(name in text for name in real_quality.COLUMNS.values())
    assert "| cacheblend:budget=0.15 | 1.000 | 100.0% |" in text
    real_quality.plot(result, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
