"""kvbench.results and kvbench.stats: what every benchmark's results file carries, and the one
definition of p50/p99."""

from __future__ import annotations

import json
import os
import random
import re

import numpy as np
import pytest

from kvbench import results, stats
from kvbench.catalog import BENCHMARKS


@pytest.mark.parametrize("n", [1, 2, 3, 7, 99, 100, 101, 150])
def test_percentiles_are_nearest_rank_as_numpy_computes_them(n):
    rng = random.Random(n)
    xs = [rng.expovariate(1.0) for _ in range(n)]
    for q in (0.5, 0.9, 0.99, 1.0):
        assert stats.percentile(xs, q) == np.percentile(xs, 100 * q, method="inverted_cdf")


def test_a_p99_of_fewer_than_100_samples_is_their_maximum_and_says_how_many():
    s = stats.summary([3.0, 1.0, 2.0], prefix="ttft_", unit="_ms", scale=1e3)
    assert s == {"ttft_n": 3, "ttft_p50_ms": 2000.0, "ttft_p99_ms": 3000.0, "ttft_mean_ms": 2000.0}
    assert stats.summary([], unit="_us")["n"] == 0 and stats.summary([], unit="_us")["p99_us"] != 0  # NaN
    with pytest.raises(ValueError):
        stats.percentile([1.0], 0.0)


def test_a_results_file_says_what_ran_where(tmp_path):
    path = results.save("eviction", ["--sizes", "10"], {"victims": [1, 2]}, tmp_path / "out.json")
    got = json.loads(path.read_text())
    assert got["name"] == "eviction" and got["command"] == "kvcraft bench eviction --sizes 10"
    assert got["victims"] == [1, 2]
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", got["commit"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", got["date"])
    m = got["machine"]
    assert m["cores"] == os.cpu_count() and m["cpu"] and m["torch"] and "vllm" in m and m["python"]


def test_a_result_cannot_overwrite_the_envelope(tmp_path):
    with pytest.raises(ValueError, match="envelope"):
        results.save("eviction", [], {"date": "yesterday"}, tmp_path / "out.json")


def test_without_a_path_a_benchmark_writes_into_the_results_folder():
    assert results.default_path("hit-rate") == results.RESULTS / "hit-rate.json"


# timeline and static-steps check the engine (its author tests them); every other benchmark
# writes its results through kvbench.results under its own name.
NO_RESULTS_FILE = {"timeline", "static-steps"}


@pytest.mark.parametrize("name", sorted(set(BENCHMARKS) - NO_RESULTS_FILE))
def test_every_benchmark_saves_one_results_file_under_its_name(name):
    import importlib

    module = importlib.import_module(BENCHMARKS[name].module)
    source = open(module.__file__).read()
    assert callable(module.main)
    assert re.search(rf'results\.(save|print_and_save)\(\s*"{name}"', source), name
