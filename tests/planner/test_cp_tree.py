import gc

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcraft.keys import variant_id
from kvcraft.records import VariantStats
from kvservice.planner import FRESH, PREFIX, ChunkRef, InMemoryCatalog, Planner, PlannerConfig, Variant
from kvservice.planner.cp_tree import CPTree

from .helpers import key, variant


def record(vid, tier):
    """The store's record of variant `vid`, living in `tier` (all a CP-Tree reads of it)."""
    return Variant.build(vid, key("x"), (), 1, tier, VariantStats())


def stored_in(tier, ids=None):
    """A catalog's `get` for a CPTree: every id (or those in `ids`) stored in `tier`."""
    return lambda vid: record(vid, tier) if ids is None or vid in ids else None

C1, C2, C5, C6 = key("C1"), key("C2"), key("C5"), key("C6")


def _engine_stores(catalog, plan, tier="gpu"):
    """What the engine does after prefill: store each freshly computed chunk as a
    variant behind the chunks before it."""
    for c in plan.chunks:
        if c.source == FRESH:
            catalog.put(variant(c.chunk_key, plan.prefix_of(c.position), tokens=c.token_count, tier=tier))


def _request(planner, catalog, keys):
    plan = planner.plan("model", "", [ChunkRef(k, 10) for k in keys], question_tokens=8)
    _engine_stores(catalog, plan)
    return plan


def test_craft_4_2_example_with_threshold_2():
    catalog = InMemoryCatalog()
    # CRAFT alone: a chunk after the prefix is computed, not fixed from a variant.
    planner = Planner(catalog, PlannerConfig(promotion_threshold=2, variants=False))
    catalog.listeners.append(planner)
    tree, ca = planner.cp_tree, planner.ca_table

    # CA-Table {C1: 1, C2: 1}, CP-Tree empty.
    _request(planner, catalog, [C1, C2])
    assert (ca.count(C1), ca.count(C2)) == (1, 1) and len(tree) == 0

    # [C1, C2, C5]: no prefix; counts C1:2 C2:2 C5:1; [C1, C2] promoted (C2 child of C1).
    plan = _request(planner, catalog, [C1, C2, C5])
    assert plan.prefix == () and [c.source for c in plan.chunks] == [FRESH] * 3
    assert (ca.count(C1), ca.count(C2), ca.count(C5)) == (2, 2, 1)
    assert tree.paths() == [(C1,), (C1, C2)]
    n2 = tree.lookup([C1, C2])[1]
    assert n2.parent.chunk_key == C1 and n2.tier == "gpu" and n2.token_span == (10, 20)

    # [C1, C2, C6]: [C1, C2] reused, only C6 computed; tree unchanged (C6: 1).
    plan = _request(planner, catalog, [C1, C2, C6])
    assert plan.prefix == (variant_id(C1, ()), variant_id(C2, (C1,)))
    assert [c.source for c in plan.chunks] == [PREFIX, PREFIX, FRESH] and plan.computed_tokens == 10
    assert (ca.count(C1), ca.count(C2), ca.count(C6)) == (3, 3, 1)
    assert sorted(tree.paths()) == [(C1,), (C1, C2)]

    # Same chunks again: C6 reaches 2 -> extension, [C1, C2, C6].
    plan = _request(planner, catalog, [C1, C2, C6])
    assert len(plan.prefix) == 2 and ca.count(C6) == 2
    assert sorted(tree.paths()) == [(C1,), (C1, C2), (C1, C2, C6)]
    plan = _request(planner, catalog, [C1, C2, C6])
    assert len(plan.prefix) == 3 and plan.computed_tokens == 0

    # [C1, C2] moves GPU -> CPU: entries updated to the new location.
    catalog.move(variant_id(C1, ()), "host")
    catalog.move(variant_id(C2, (C1,)), "host")
    assert [n.tier for n in tree.lookup([C1, C2, C6])] == ["host", "host", "gpu"]
    plan = _request(planner, catalog, [C1, C2, C6])
    assert [c.tier for c in plan.chunks] == ["host", "host", "gpu"]

    # Removed entirely: the nodes go, and no plan names the deleted variant.
    catalog.evict(variant_id(C2, (C1,)))
    assert tree.paths() == [(C1,)]
    plan = _request(planner, catalog, [C1, C2, C6])
    assert plan.prefix == (variant_id(C1, ()),)
    assert all(c.variant_id is None or c.variant_id in catalog for c in plan.chunks)


def test_sub_prefix_of_longer_path_is_reusable():
    # CRAFT §4.2 "prefix slicing": [C1, C2, C3] cached -> [C1, C10, C11] reuses C1.
    stored = set()
    tree = CPTree(stored_in("gpu", stored))
    path = [key("C1"), key("C2"), key("C3")]
    stored.update(variant_id(k, path[:i]) for i, k in enumerate(path))
    tree.insert(path, [5, 5, 5])
    assert [n.chunk_key for n in tree.lookup([key("C1"), key("C10"), key("C11")])] == [key("C1")]
    assert len(tree.lookup([key("C1"), key("C2")])) == 2
    assert tree.lookup([key("C2")]) == []


def test_pending_node_stops_lookup_until_its_variant_is_stored():
    tree = CPTree(lambda vid: None)
    path = [key("a"), key("b")]
    tree.insert(path, [3, 4])
    assert tree.lookup(path) == []
    tree.on_put(variant(path[0], (), tier="disk"))
    assert len(tree.lookup(path)) == 1
    tree.on_put(variant(path[1], path[:1], tier="host"))
    assert [n.tier for n in tree.lookup(path)] == ["disk", "host"]


def test_promotion_takes_leading_run_and_extension_one_chunk():
    counts = {key("a"): 2, key("b"): 3, key("c"): 1, key("d"): 5, key("e"): 2}
    tree = CPTree(stored_in("gpu"), threshold=2)
    ks = [key("a"), key("b"), key("c"), key("d")]
    tree.update(ks, [1] * 4, counts.get, reused=0)
    assert sorted(tree.paths()) == [(ks[0],), (ks[0], ks[1])]
    # reused [a, b]; next chunk d reaches the threshold -> only d is added
    ks2 = [key("a"), key("b"), key("d"), key("e")]
    tree.update(ks2, [1] * 4, counts.get, reused=2)
    assert sorted(tree.paths())[-1] == tuple(ks2[:3])
    # reused [a, b, d]; e reaches it too, but the next chunk is c (count 1): nothing
    tree.update([key("a"), key("b"), key("d"), key("c")], [1] * 4, counts.get, reused=3)
    assert len(tree) == 3


alphabet = [key(c) for c in "abcd"]
paths = st.lists(st.sampled_from(alphabet), min_size=1, max_size=4)
ops = st.lists(st.tuples(st.sampled_from(["insert", "put", "evict", "move"]), paths), max_size=25)


@settings(max_examples=200, deadline=None)
@given(ops, st.lists(st.lists(st.sampled_from(alphabet), max_size=5), min_size=1, max_size=5))
def test_lookup_matches_scan_of_all_cached_prefixes(operations, queries):
    catalog = InMemoryCatalog()
    tree = CPTree(catalog.get)
    catalog.listeners.append(_TreeHooks(tree))
    model_paths: set[tuple[str, ...]] = set()  # brute-force reference of the tree's paths

    def vid(p):
        return variant_id(p[-1], p[:-1])

    for op, p in operations:
        p = tuple(p)
        if op == "insert":
            tree.insert(p, [1] * len(p))
            model_paths.update(p[:i] for i in range(1, len(p) + 1))
        elif op == "put":
            catalog.put(variant(p[-1], p[:-1], tokens=1))
        elif op == "evict" and vid(p) in catalog:
            catalog.evict(vid(p))
            model_paths = {q for q in model_paths if q[: len(p)] != p}
        elif op == "move" and vid(p) in catalog:
            catalog.move(vid(p), "disk")

    def live(q):
        return all(q[:i] in model_paths and vid(q[:i]) in catalog for i in range(1, len(q) + 1))

    for q in queries:
        best = max((len(c) for c in model_paths if live(c) and tuple(q[: len(c)]) == c), default=0)
        got = tree.lookup(q)
        assert len(got) == best
        for i, node in enumerate(got):
            info = catalog.get(node.variant_id)
            assert info is not None and node.tier == info.tier
            assert node.chunk_key == q[i]


class _TreeHooks:
    def __init__(self, tree):
        self.tree = tree

    def on_put(self, info):
        self.tree.on_put(info)

    def on_evict(self, vid):
        self.tree.on_evict(vid)


def test_follow_takes_an_existing_path_of_the_requests_chunks_live_first():
    live = {"p/a", "p/a/c"}
    tree = CPTree(stored_in("host", live), variant_id_fn=lambda k, ks: "/".join(["p", *ks, k]))
    tree.insert(["a", "b"], [1, 1])   # pending path a -> b
    tree.insert(["a", "c"], [1, 1])   # live path a -> c
    assert tree.follow(["b", "c", "a"]) == ["a", "c"]          # live child before a pending one
    assert tree.follow(["b", "a"]) == ["a", "b"]               # a pending path still fixes the order
    assert tree.follow(["x", "b"]) == []                       # no path starts with these chunks


def _named(k, ks):
    return "/".join(["p", *ks, k])


def test_a_node_still_pending_after_the_window_goes_with_its_subtree():
    """A promoted path whose KV never arrives leaves the tree `pending_window` requests
    after its insertion; one stored within the window stays."""
    stored: set[str] = set()
    tree = CPTree(stored_in("host", stored), variant_id_fn=_named, pending_window=3)
    always = lambda k: 2  # noqa: E731 (every chunk at the threshold)
    assert [n.variant_id for n in tree.update(["a", "b"], [1, 1], always, 0)] == ["p/a", "p/a/b"]  # update 1
    tree.update(["x", "y"], [1, 1], always, 0)  # update 2: another pending path
    tree.on_put(record("p/x", "host"))          # ... whose first node gets stored
    stored.add("p/a/b/c")
    tree.insert(["a", "b", "c"], [1, 1, 1])     # a live node below the pending ones (not tracked)
    tree.update(["q"], [1], lambda k: 0, 0)     # update 3: nothing promoted
    assert len(tree) == 5
    tree.update(["q"], [1], lambda k: 0, 0)     # update 4: a and a/b were inserted 3 updates ago
    assert tree.node_of("p/a") is None and tree.node_of("p/a/b/c") is None
    assert sorted(tree.paths(live_only=False)) == [("x",), ("x", "y")]
    tree.update(["q"], [1], lambda k: 0, 0)     # update 5: x is live and stays; x/y goes
    assert tree.paths(live_only=False) == [("x",)] and tree.lookup(["x", "y"])[0].variant_id == "p/x"


def test_the_tree_stays_bounded_when_nothing_is_ever_stored():
    """Every request inserts at most len(keys) nodes and a pending node lives at most
    `window` requests: with no variant ever stored, the tree never holds more than
    window x len(keys) nodes (it grew without bound before)."""
    import random

    rng = random.Random(3)
    catalog = InMemoryCatalog()
    window = 50
    planner = Planner(catalog, PlannerConfig(ca_window=window))
    catalog.listeners.append(planner)
    chunks = [key(f"c{i}") for i in range(300)]
    most = 0
    for _ in range(3000):
        keys = rng.sample(chunks[:20], 3) + rng.sample(chunks, 2)
        planner.plan("model", "", [ChunkRef(k, 10) for k in keys], question_tokens=8)
        most = max(most, len(planner.cp_tree))
    assert 0 < most <= window * 5


def test_planning_leaves_no_reference_cycles():
    """Garbage in a reference cycle waits for the cyclic collector, whose pauses land in
    whatever Plan happens to allocate next (~250 µs each at a million variants): a Plan,
    with its CP-Tree follow, promotion, extension and pending expiry, frees all it
    made by reference counting."""
    catalog = InMemoryCatalog()
    planner = Planner(catalog, PlannerConfig(promotion_threshold=2, ca_window=20))
    catalog.listeners.append(planner)
    keys = [key(f"C{i}") for i in range(12)]
    requests = [[keys[(i * 7 + j * 5) % 12] for j in range(4)] for i in range(60)]
    for r in requests[:30]:  # promoted paths (live and pending) for `follow` to find
        plan = planner.plan("model", "", [ChunkRef(k, 10) for k in r], question_tokens=8)
        if len(plan.order) % 2:
            _engine_stores(catalog, plan)
    assert len(planner.cp_tree) > 0
    gc.collect()
    gc.disable()
    try:
        for r in requests[30:]:
            plan = planner.plan("model", "", [ChunkRef(k, 10) for k in r], question_tokens=8)
        unreachable = gc.collect()
    finally:
        gc.enable()
    assert unreachable == 0
