"""bench/service/fetch.py measures a path and its limit in turn, the order flipped every other
repeat, so a machine whose speed drifts during the run favours neither side."""

from kvbench.service.fetch import _paired


def test_paths_take_turns_in_alternating_order():
    calls = []
    times = _paired({"ours": lambda i: calls.append(("ours", i)), "limit": lambda i: calls.append(("limit", i))}, 4)
    assert calls == [("ours", 0), ("limit", 0), ("limit", 1), ("ours", 1),
                     ("ours", 2), ("limit", 2), ("limit", 3), ("ours", 3)]
    assert [len(t) for t in times.values()] == [4, 4] and all(s >= 0 for t in times.values() for s in t)
