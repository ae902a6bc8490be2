from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvservice.planner.ca_table import CATable
from kvservice.planner.reorder import reorder_by_count

requests = st.lists(st.lists(st.integers(0, 8), max_size=6), max_size=40)


@settings(max_examples=150, deadline=None)
@given(requests, st.integers(1, 10))
def test_counts_match_last_window_requests(reqs, window):
    t = CATable(window)
    for r in reqs:
        t.observe(str(k) for k in r)
    expected = Counter()
    for r in reqs[-window:]:
        expected.update(set(str(k) for k in r))
    assert {str(k): t.count(str(k)) for k in range(9)} == {str(k): expected[str(k)] for k in range(9)}
    assert len(t) == len(+expected)


def test_chunk_counted_once_per_request():
    t = CATable(5)
    t.observe(["a", "a", "b"])
    assert t.count("a") == 1 and t.count("b") == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 4)), max_size=12, unique_by=lambda x: x[0]))
def test_reorder_is_stable_descending_sort(items):
    counts = dict(items)
    keys = [k for k, _ in items]
    out = reorder_by_count(keys, counts.__getitem__)
    assert sorted(out) == sorted(keys)
    # descending by count; among equal counts the retriever order is kept
    for x, y in zip(out, out[1:]):
        assert counts[x] > counts[y] or (counts[x] == counts[y] and keys.index(x) < keys.index(y))


def test_reorder_example_from_craft_4_2():
    # {C1,C2,C3} and {C2,C3,C4} with C2, C3 hotter both start [C2, C3, ...].
    counts = {"C1": 1, "C2": 5, "C3": 4, "C4": 1}
    assert reorder_by_count(["C1", "C2", "C3"], counts.get)[:2] == ["C2", "C3"]
    assert reorder_by_count(["C2", "C3", "C4"], counts.get)[:2] == ["C2", "C3"]
