"""kvbench.quality.real_bound without the model: the summary's standard errors and paired differences."""

from __future__ import annotations

import statistics

import pytest

from kvbench.quality import real_bound


def test_the_summary_pairs_each_case_with_the_default_record_by_record():
    rouge = {"full": [1.0, 1.0, 1.0], "query (default)": [0.5, 0.9, 0.7], "deviation 15%": [0.6, 0.8, 1.0]}
    records = [{"served": {label: {"rouge_l_vs_full": got[i], "identical_to_full": 0.0, "first_token_agrees": 1.0,
                                   "f1": 0.0, "computed_share": 0.15} for label, got in rouge.items()}}
               for i in range(3)]
    rows = {r["case"]: r for r in real_bound.summarize(records)}
    dev = rows["deviation 15%"]
    assert dev["rouge_l_vs_full"] == pytest.approx(0.8)
    assert dev["rouge_l_se"] == pytest.approx(statistics.stdev([0.6, 0.8, 1.0]) / 3 ** 0.5)
    assert dev["rouge_l_vs_default"] == pytest.approx(0.1)
    assert dev["rouge_l_vs_default_se"] == pytest.approx(statistics.stdev([0.1, -0.1, 0.3]) / 3 ** 0.5)
    assert rows["query (default)"]["rouge_l_vs_default"] == 0.0
    assert "| deviation 15% | 0.800 | 0.115 | +0.100 (0.115) |" in real_bound.table({"cases": list(rows.values())})
