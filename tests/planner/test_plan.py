import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvservice.planner import (
    FRESH, PREFIX, VARIANT, ChunkRef, InMemoryCatalog, PlanError, Planner, PlannerConfig,
)

from .helpers import key, variant


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def make(**cfg):
    catalog = InMemoryCatalog()
    planner = Planner(catalog, PlannerConfig(**cfg), clock=Clock())
    catalog.listeners.append(planner)
    return catalog, planner


def refs(*names, tokens=10):
    return [ChunkRef(key(n), tokens) for n in names]


def test_first_turn_reordered_by_count_later_turn_keeps_retriever_order_and_drops_history():
    catalog, planner = make()
    for _ in range(3):
        planner.plan("m", "", refs("hot"), 4)
    p1 = planner.plan("m", "conv", refs("a", "hot", "b"), 4)
    assert p1.first_turn and p1.order == (key("hot"), key("a"), key("b"))
    p2 = planner.plan("m", "conv", refs("c", "b", "hot", "d"), 4)
    assert not p2.first_turn
    assert p2.order == (key("c"), key("d")) and p2.dropped == (key("b"), key("hot"))
    assert p2.history == p1.order and p2.prefix_of(1) == p1.order + (key("c"),)


def test_later_turn_uses_history_as_variant_context_and_no_prefix_tree():
    catalog, planner = make()
    planner.plan("m", "conv", refs("a"), 4)
    # a variant of x computed behind [a]: exact for turn 2, where x follows history [a]
    catalog.put(variant(key("x"), [key("a")]))
    p2 = planner.plan("m", "conv", refs("x"), 4)
    assert p2.chunks[0].source == VARIANT and p2.chunks[0].cfo == 0.0
    assert p2.prefix == ()


def test_variant_choice_and_recompute_tokens_in_plan():
    catalog, planner = make(alpha=1.0)
    v = variant(key("x"), [key("q")], tokens=10, a=1.0, b=1.0)
    catalog.put(v)
    plan = planner.plan("m", "", refs("x"), 4)
    c = plan.chunks[0]
    assert c.source == VARIANT and c.variant_id == v.variant_id
    assert len(c.recompute) == 8  # CFO = sigmoid(1) * (1 - 0) = 0.731 -> ceil(7.31)
    assert c.recompute == tuple(v.recompute_order[:8])
    assert plan.reuse_cfo == ((v.variant_id, c.cfo),)
    assert plan.computed_tokens == 8 and plan.retrieved_tokens == 10


def test_first_turn_flag_overrides_conversation_inference():
    catalog, planner = make()
    for _ in range(3):
        planner.plan("m", "", refs("a", "b"), 4)
        catalog.put(variant(key("a"), []))
        catalog.put(variant(key("b"), [key("a")]))
    assert len(planner.plan("m", "", refs("a", "b"), 4).prefix) == 2
    p = planner.plan("m", "forgotten", refs("a", "b"), 4, first_turn=False)
    assert p.prefix == () and all(c.source != PREFIX for c in p.chunks)


def test_bad_requests_raise_plan_error():
    _, planner = make()
    with pytest.raises(PlanError):
        planner.plan("", "", refs("a"), 1)
    with pytest.raises(PlanError):
        planner.plan("m", "", [ChunkRef(key("a"), 0)], 1)
    with pytest.raises(PlanError):
        planner.plan("m", "", refs("a"), -1)


def test_empty_request_plans_nothing():
    _, planner = make()
    p = planner.plan("m", "", [], 7)
    assert p.chunks == () and p.computed_tokens == 0 and p.preload_depth == 1


names = st.sampled_from("abcdef")
steps = st.lists(st.tuples(st.sampled_from(["plan", "evict", "move"]),
                           st.lists(names, max_size=4), st.sampled_from(["", "c1", "c2"])),
                 max_size=30)


@settings(max_examples=120, deadline=None)
@given(steps)
def test_plan_never_names_a_variant_that_is_not_stored(ops):
    catalog, planner = make(promotion_threshold=2)
    for op, ns, conv in ops:
        if op == "plan":
            plan = planner.plan("m", conv, refs(*ns), 3)
            for c in plan.chunks:
                if c.variant_id is not None:
                    info = catalog.get(c.variant_id)
                    assert info is not None and info.tier == c.tier and info.chunk_key == c.chunk_key
                if c.source != PREFIX:
                    catalog.put(variant(c.chunk_key, plan.prefix_of(c.position)))
            assert sorted(plan.order + plan.dropped) == sorted(key(n) for n in ns)
        elif op == "evict" and len(catalog):
            vid = sorted(catalog._by_id)[len(ns) % len(catalog)]
            catalog.evict(vid)
        elif op == "move" and len(catalog):
            vid = sorted(catalog._by_id)[len(ns) % len(catalog)]
            catalog.move(vid, "disk")


def test_a_chunk_set_seen_before_keeps_its_order_after_counts_change():
    """CRAFT §4.2: a request follows an existing CP-Tree path before the rest is reordered."""
    for follow in (True, False):
        catalog, planner = make(follow_prefix=follow)
        first = [planner.plan("m", "", refs("a", "b", "c"), 4).order for _ in range(2)]
        # c becomes the most retrieved chunk: a plain count sort would now put it first
        for _ in range(3):
            planner.plan("m", "", refs("c", "x"), 4)
        again = planner.plan("m", "", refs("c", "b", "a"), 4).order
        if follow:
            assert again == first[1] == (key("a"), key("b"), key("c"))
        else:
            assert again[0] == key("c")  # the control: without following, the order changes


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_plan_chooses_what_choose_variant_chooses(data):
    """The planner's inlined variant choice (fast paths for 0 and 1 prefix chunks) picks
    the variant and CFO that `choose_variant` (composed eq. 6-12) picks, behind any
    history, for variants with 0-3 prefix chunks, equal CFOs and tier ties included."""
    from kvservice.planner.variants import choose_variant

    alpha = data.draw(st.sampled_from([0.15, 0.5, 1.0, 3.0]))
    max_cfo = data.draw(st.sampled_from([1.0, 0.3]))
    catalog, planner = make(alpha=alpha, max_cfo=max_cfo, reorder=False, prefix_tree=False, dedup=False)
    names = [f"c{i}" for i in range(6)]
    for chunk in names:
        for _ in range(data.draw(st.integers(0, 3))):
            prefix = data.draw(st.lists(st.sampled_from([n for n in names if n != chunk]), max_size=3, unique=True))
            pa = data.draw(st.sampled_from([None, [0.0] * len(prefix), [1.0 + i for i in range(len(prefix))]]))
            v = variant(key(chunk), [key(p) for p in prefix], tier=data.draw(st.sampled_from(["host", "disk"])),
                        a=data.draw(st.sampled_from([0.0, 0.4, 2.0])), b=data.draw(st.sampled_from([0.0, 1.0])),
                        prefix_attention=pa)
            catalog.put(v)
    history = data.draw(st.lists(st.sampled_from(names), max_size=3, unique=True))
    if history:
        planner.plan("m", "conv", refs(*history), 4)
    asked = data.draw(st.lists(st.sampled_from([n for n in names if n not in history]), min_size=1, max_size=4,
                               unique=True))
    p = planner.plan("m", "conv" if history else "", refs(*asked), 4)
    s_new = {k: i for i, k in enumerate(p.history)}
    for c in p.chunks:
        want = choose_variant(catalog.variants_of(c.chunk_key), s_new, alpha, max_cfo)
        if want is None:
            assert c.source == FRESH and c.variant_id is None
        else:
            assert (c.source, c.variant_id, c.cfo) == (VARIANT, want.info.variant_id, want.cfo)
        s_new[c.chunk_key] = len(s_new)


def test_controllers_stay_bounded_and_the_busy_model_keeps_its_estimates():
    """A client naming ever new model ids cannot grow the planner without bound; a model
    planned all along keeps what its engine's timings taught its controller."""
    from kvservice.planner.plan import MAX_MODELS

    planner = Planner(InMemoryCatalog())
    busy = "b" * 32
    for tokens in (50.0, 100.0, 200.0, 400.0):  # 50 ms per token: far slower than the default profile
        planner.observe_compute(busy, tokens, tokens * 0.05)
    taught = planner.controller(busy).compute.predict(100.0)
    fresh = Planner(InMemoryCatalog()).controller(busy).compute.predict(100.0)
    assert taught != fresh
    for i in range(4 * MAX_MODELS):
        planner.plan(f"{i:032x}", "", [ChunkRef(key("c"), 10)], 8)
        if i % 50 == 0:
            planner.plan(busy, "", [ChunkRef(key("c"), 10)], 8)
    assert len(planner._controllers) == MAX_MODELS
    assert planner.controller(busy).compute.predict(100.0) == taught


score = st.sampled_from([0.0, 0.25, 1.0, 2.0, 3.5])  # ties and zeros (allocate never picks a 0)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_merged_scores_is_merge_scores(data):
    """The planner's inlined merge of a chunk's learned scores equals folding its
    variants' lists with `kvcraft.recompute.merge_scores` (elementwise max)."""
    from kvcraft.recompute import merge_scores

    from kvservice.planner.plan import merged_scores

    n = data.draw(st.integers(1, 8))
    floats = st.one_of(score, st.floats(-2.0, 5.0, allow_nan=False))
    lists = data.draw(st.lists(st.lists(floats, min_size=n, max_size=n).map(tuple), max_size=5))
    assert tuple(merged_scores(lists)) == functools.reduce(merge_scores, lists, ())


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_plan_learned_recompute_is_allocate_over_merge_scores(data):
    """A reused chunk whose variants carry learned scores gets its recompute from the
    scores of all its variants (of the chunk's length) folded with `merge_scores`, the
    plan's ratio spent on them prompt-wide with `allocate`, highest score first; a chunk
    without any keeps Cache-Craft's top ceil(CFO |C|) of the chosen variant's order."""
    from kvcraft.recompute import allocate, merge_scores

    from kvservice.planner.variants import recompute_count

    r_min = data.draw(st.sampled_from([0.15, 0.5, 1.0]))
    catalog, planner = make(alpha=data.draw(st.sampled_from([0.15, 1.0])), r_min=r_min)
    names = [f"c{i}" for i in range(5)]
    for chunk in names:
        for prefix in data.draw(st.lists(st.sampled_from([(), ("c0",), ("c1", "c2"), ("x",)]), max_size=3,
                                         unique=True)):
            learned = data.draw(st.one_of(st.just(()), st.lists(score, min_size=10, max_size=10)))
            catalog.put(variant(key(chunk), [key(p) for p in prefix if p != chunk], a=0.4,
                                recompute_scores=learned))
    asked = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=5, unique=True))
    p = planner.plan("m", "", [ChunkRef(key(k), 10) for k in asked], 4)
    for k in (k for k in asked if catalog.variants_of(key(k))):  # a stored chunk asked with another count
        with pytest.raises(PlanError, match="is stored with 10 tokens"):
            planner.plan("m", "", [ChunkRef(key(k), 12)], 4)

    want: dict[int, tuple[float, ...]] = {}
    for j, c in enumerate(p.chunks):
        if c.source != VARIANT:
            continue
        lists = [v.stats.recompute_scores for v in catalog.variants_of(c.chunk_key)
                 if len(v.stats.recompute_scores) == c.token_count]
        if lists:
            want[j] = functools.reduce(merge_scores, lists, ())
        else:
            best = catalog.get(c.variant_id)
            assert c.recompute == tuple(best.recompute_order[: recompute_count(c.cfo, c.token_count)])
    chosen = allocate(want, p.ratio) if want else {}
    for j, toks in chosen.items():
        sc = want[j]
        assert p.chunks[j].recompute == tuple(sorted(toks, key=lambda t: (-sc[t], t)))
