"""The service benchmarks no other test runs, at a tiny size: plan-latency, front-order, and
hit-rate against a cache simulated independently. (eviction and reuse-writes: test_cli.py.)"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvbench.common.workload import DEFAULT, generate
from kvbench.service import front_order, hit_rate, plan_latency

PATHS = ("in_process_", "in_process_cpu_", "service_cpu_", "service_cpu_held_leases_", "grpc_", "blocking_",
         "stream_", "floor_")


def test_plan_latency_times_every_path_on_every_request(tmp_path):
    out = tmp_path / "plan-latency.json"
    assert plan_latency.main(["--sizes", "2000", "--requests", "200", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert result["name"] == "plan-latency" and row["variants"] == 2000 and row["requests"] == 200
    for p in PATHS:
        assert row[f"{p}n"] == 200, p
        assert 0 < row[f"{p}p50_us"] <= row[f"{p}p99_us"], p
    assert row["server_peak_rss_gb"] > 0 and row["calib_ms"] > 0


def test_front_order_replays_each_first_turn_three_times(tmp_path):
    out = tmp_path / "front-order.json"
    assert front_order.main(["--conversations", "30", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    trace = generate(replace(DEFAULT, conversations=30, corpus=1000))
    first_turns = len({r.conv_id for r in trace if r.conv_id}) + sum(1 for r in trace if not r.conv_id)
    assert [r["follow_prefix"] for r in result["rows"]] == [False, True]
    for r in result["rows"]:
        assert r["requests"] == first_turns
        assert 0 <= r["second_pass_same_order"] <= first_turns and 0 <= r["third_pass_same_order"] <= first_turns
        assert r["seen_set_same_order"] <= r["seen_set_requests"]


def _brute_force(trace, capacity: int, key) -> int:  # noqa: ANN001
    """Tokens hit by a cache that scans everything it holds for the victim: an independent model
    of `hit_rate.replay` (dicts, no sorted structure, no kvservice)."""
    held: dict[str, dict] = {}
    hit = now = 0
    for r in trace:
        for k, tokens in r.chunks:
            now += 1
            if k in held:
                hit += tokens
                held[k]["fr"] += 1.0
                held[k]["last"] = now
                continue
            if tokens > capacity:
                continue
            while sum(v["tokens"] for v in held.values()) + tokens > capacity:
                del held[min(held, key=lambda x: key(held[x], x))]
            held[k] = {"fr": 0.0, "last": now, "created": now, "tokens": tokens}
    return hit


REFERENCE_ORDERS = {"fr (the store's)": lambda v, k: (v["fr"], v["last"], v["created"], k),
                    "lru": lambda v, k: (v["last"], v["created"], k),
                    "fifo": lambda v, k: (v["created"], k)}


@pytest.mark.parametrize("share", [0.05, 0.3])
def test_hit_rate_evicts_in_each_order_as_a_brute_force_cache_does(share):
    trace = generate(replace(DEFAULT, conversations=40, corpus=400))
    capacity = int(share * hit_rate.working_set(trace))
    for name, order in hit_rate.ORDERS.items():
        assert hit_rate.replay(trace, capacity, order)["hit_tokens"] == _brute_force(trace, capacity,
                                                                                     REFERENCE_ORDERS[name]), name


def test_a_cache_holding_the_working_set_misses_only_first_sightings(tmp_path):
    trace = generate(replace(DEFAULT, conversations=40))  # the default preset's trace, as the command makes it
    seen: set[str] = set()
    again = 0
    for r in trace:
        for k, tokens in r.chunks:
            again += tokens if k in seen else 0
            seen.add(k)
    out = tmp_path / "hit-rate.json"
    assert hit_rate.main(["--preset", "default", "--conversations", "40", "--capacities", "1.0", "--json", str(out)]) == 0
    (t,) = json.loads(out.read_text())["traces"]
    assert {r["order"]: r["hit_tokens"] for r in t["rows"]} == {name: again for name in hit_rate.ORDERS}
    assert all(r["evictions"] == 0 for r in t["rows"])
