"""The benchmark's own measurements, on tiny inputs."""

from dataclasses import replace

from kvbench.service.planner import token_shares
from kvbench.common.workload import DEFAULT, Request, generate, trace_stats


def _req(names, conv="", turn=0):
    return Request(conv, turn, tuple((n, 100) for n in names), 10)


def test_trace_stats_reproduce_craft_3_1_example():
    # R1 = [C1, C4, C5, C6, C7], R2 = [C1, C2, C3, C4, C5]: LCP 1, shared 3 of k = 5.
    s = trace_stats([_req(["C1", "C4", "C5", "C6", "C7"]), _req(["C1", "C2", "C3", "C4", "C5"])])
    assert s["prefix_aligned"] == 0.2 and s["total_overlap"] == 0.6
    assert s["seen_before"] == 3 / 10


def test_conversation_duplicate_share_counts_later_turns():
    s = trace_stats([_req(["a", "b"], "c", 0), _req(["b", "x"], "c", 1), _req(["b", "y"], "d", 0)])
    assert s["conv_dup_later_turns"] == 0.5


def test_generator_is_seeded():
    cfg = replace(DEFAULT, conversations=20, corpus=500)
    assert generate(cfg) == generate(cfg)
    assert generate(cfg) != generate(replace(cfg, seed=1))


def test_policy_shares_on_a_small_trace():
    trace = generate(replace(DEFAULT, conversations=60, corpus=300, zipf_s=1.1))
    sh = token_shares(trace, show_progress=False)
    assert sh["no-cache"] == 1.0
    assert sh["craft"] <= sh["prefix-caching"] < 1.0
    assert sh["oracle"] <= sh["craft+cache-craft"] + 1e-9 <= sh["craft"] + 1e-9
