"""Query-aware selection (engine_adapter/policies/default.py, picks.py): what the question
reads, and the two passes."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from engine_adapter.blend import blend_prefill, prefill_with_picks
from engine_adapter.policies import default, picks as picking
from engine_adapter.policies.picks import Picks, QuestionReads, most_read, picks_budget
from engine_adapter.policy import Policy
from engine_adapter.probe import TRUSTED
from engine_adapter.prompt import Layout, Segment
from engine_adapter.source import InMemoryLayerSource
from kvkernels import apply_rope
from tests.engine_adapter.adapter_helpers import make_prompt, question_reads, reference_shallow_rows, rel_dev, variant


@pytest.fixture(scope="module")
def prompts(engine):
    return [make_prompt(engine, seed, behind="other") for seed in range(6)]


def _layout(engine, p):
    return Layout.of(p.segments(), engine.model_spec().fingerprint())


def _second_pass(engine, p, q: QuestionReads, picks: Picks):  # noqa: ANN001, ANN202
    """The default's second pass alone, with these picks, after the question pass `q`."""
    return prefill_with_picks(engine, _layout(engine, p), q, picks, p.source())


@torch.no_grad()
def reference_reads(engine, p) -> torch.Tensor:
    """Naive reuse in plain torch: the question's rows over the stored chunks' KV (K rotated
    to their rows), explicit softmax; their attention probabilities summed over heads,
    rows and layers 1..L-2."""
    c = engine.cfg
    g = c.num_heads // c.num_kv_heads
    n_ctx = sum(map(len, p.chunks))
    n = n_ctx + len(p.question)
    qpos = torch.arange(n_ctx, n)
    starts = [sum(map(len, p.chunks[:i])) for i in range(len(p.chunks))]
    h = engine.embed(torch.tensor(p.question))
    reads = torch.zeros(n)
    for layer in range(c.num_layers):
        q, k, v = engine.qkv_heads(layer, h).split([c.num_heads, c.num_kv_heads, c.num_kv_heads])
        ks = [apply_rope(p.cache[i].kv[layer][0], torch.arange(s, s + len(ch)), engine.rope)
              for i, (s, ch) in enumerate(zip(starts, p.chunks))]
        K = torch.cat(ks + [apply_rope(k, qpos, engine.rope)], dim=1).repeat_interleave(g, 0)
        V = torch.cat([p.cache[i].kv[layer][1] for i in range(len(p.chunks))] + [v], dim=1).repeat_interleave(g, 0)
        s = (apply_rope(q, qpos, engine.rope) @ K.transpose(1, 2)) * engine.scale
        s = s.masked_fill(torch.arange(n)[None, None, :] > qpos[None, :, None], float("-inf"))
        prob = s.softmax(-1)
        if 0 < layer < c.num_layers - 1:
            reads += prob.sum((0, 1))
        o = prob @ V
        h = engine.layer_out(layer, h, o)
    return reads


def test_the_question_pass_measures_what_the_question_reads_over_the_stored_kv(engine, prompts):
    for p in prompts[:3]:
        got = question_reads(engine, p.segments(), p.source())
        ref = reference_reads(engine, p)
        assert torch.allclose(got.reads, ref, rtol=1e-4, atol=1e-5)
        assert got.result.computed_rows == [len(p.question)] * (engine.cfg.num_layers - 1)


@pytest.mark.parametrize("budget", [0.15, 0.3, 0.6])
def test_both_passes_together_stay_within_the_budget_and_spend_it(engine, prompts, budget):
    policy = Policy("query", budget=budget, deviation=0)  # the reads alone (the joined's layer 0: below)
    for p in prompts:
        r = blend_prefill(engine, p.segments(), policy, p.source(), gate=TRUSTED)
        n, L = len(p.tokens), engine.cfg.num_layers
        picks = picks_budget(policy, _layout(engine, p), n - len(p.question), L)
        assert picks > 0
        assert r.computed_share <= budget + 1e-9
        assert budget - r.computed_share < 1 / n  # less than one more pick would have fitted
        # the question through 0..L-2 (question pass) and 1..L-1 (pass 2), then the picks: rows
        # through every layer and chunk-head rows through the first half, within `picks`
        # rows' worth of row-layers, less than one more row short of it
        picked = sum(r.recomputed_rows)
        assert sum(r.computed_rows) == 2 * len(p.question) * (L - 1) + picked
        assert picks * L - L < picked <= picks * L
        deep, shallow = r.recomputed_rows[-1], r.recomputed_rows[0] - r.recomputed_rows[-1]
        assert r.recomputed_rows == [deep + shallow] * (L // 2) + [deep] * (L - L // 2)


def test_a_budget_that_the_question_alone_uses_up_serves_naive_reuse_in_one_pass(engine, prompts):
    """Naive reuse, not the plan's recompute lists the segments carry (those are cachecraft's)."""
    p = prompts[0]
    low = len(p.question) / len(p.tokens)  # two passes would compute the question twice
    r = blend_prefill(engine, p.segments(recompute=0.2), Policy("query", budget=low), p.source(), gate=TRUSTED)
    naive = blend_prefill(engine, p.segments(), Policy("naive"), p.source(), gate=TRUSTED)
    assert torch.equal(r.logits, naive.logits)
    assert r.computed_rows == naive.computed_rows


def test_the_service_is_read_once_per_layer(engine, prompts):
    p = prompts[0]
    src = p.source()
    blend_prefill(engine, p.segments(), Policy("query", budget=0.3), src, gate=TRUSTED)
    assert src.requested == list(range(engine.cfg.num_layers))


def test_a_chunk_missing_from_layer_0_is_computed_in_both_passes_and_reported_once(engine, prompts):
    p = prompts[1]
    every = {(i, 0) for i in range(len(p.chunks))}
    r = blend_prefill(engine, p.segments(), Policy("query", budget=0.3), p.source(withhold=every), gate=TRUSTED)
    ref = engine.prefill(p.tokens, all_logits=False)[0][-1]
    assert rel_dev(r.logits, ref) < 1e-5
    assert sorted(r.fallbacks) == [(i, 0) for i in range(len(p.chunks))]


def test_chunks_missing_from_the_layer_where_head_rows_stop_are_computed_in_full(engine, prompts):
    """Every chunk late at layer 1, the last its head rows would run: pass 1 falls back
    there, pass 2 computes the chunks whole, and the prefill is full prefill's."""
    p = prompts[1]
    every = {(i, 1) for i in range(len(p.chunks))}
    r = blend_prefill(engine, p.segments(), Policy("query", budget=0.3), p.source(withhold=every), gate=TRUSTED)
    assert rel_dev(r.logits, engine.prefill(p.tokens, all_logits=False)[0][-1]) < 1e-5
    assert sorted(r.fallbacks) == sorted(every)


def test_every_reused_row_picked_is_full_prefill(engine, prompts):
    """With every reused token recomputed, pass 2 is a full prefill whose question rows
    started at layer 1 from the question pass's layer 0: the same logits and cache."""
    p = prompts[2]
    q = question_reads(engine, p.segments(), p.source())
    every = Picks({s: tuple(range(len(c))) for s, c in enumerate(p.chunks)}, torch.tensor([], dtype=torch.long),
                  engine.cfg.num_layers)
    r = _second_pass(engine, p, q, every)
    logits, kv = engine.prefill(p.tokens, all_logits=False)
    assert rel_dev(r.logits, logits[-1]) < 1e-5
    for (k, v), (rk, rv) in zip(kv, r.kv):
        assert torch.allclose(k, rk, atol=1e-4) and torch.allclose(v, rv, atol=1e-4)


def test_one_question_pass_serves_many_second_passes_each_as_if_alone(engine, prompts):
    """The benchmarks rank rows many ways after one question pass (`kvcraft bench real-bound`):
    a second pass must not see the rows an earlier one wrote into the question pass's caches."""
    p = prompts[2]
    q = question_reads(engine, p.segments(), p.source())
    none = torch.tensor([], dtype=torch.long)
    many = Picks({0: tuple(range(len(p.chunks[0]))), 1: (0, 1, 2)}, none, engine.cfg.num_layers)
    one = Picks({0: (1,)}, none, engine.cfg.num_layers)
    alone = _second_pass(engine, p, question_reads(engine, p.segments(), p.source()), one)
    _second_pass(engine, p, q, many)  # (not every row: that pass would be a full prefill, reading no cache)
    after = _second_pass(engine, p, q, one)
    assert torch.equal(after.logits, alone.logits)
    assert all(torch.equal(a, b) for x, y in zip(after.kv, alone.kv) for a, b in zip(x, y))


def test_chunk_head_rows_run_the_first_layers_then_keep_the_stored_kv(engine, prompts):
    """Every reused row a head row through layers 0..1 of 4: those layers' KV is full
    prefill's, the later layers' the stored KV, and the question reads them as a plain
    torch prefill that stops the chunks' rows after layer 1 does."""
    p, depth = prompts[2], 2
    q = question_reads(engine, p.segments(), p.source())
    n_ctx = sum(map(len, p.chunks))
    picks = Picks({s: tuple(range(len(c))) for s, c in enumerate(p.chunks)}, torch.arange(n_ctx), depth)
    r = _second_pass(engine, p, q, picks)
    logits, kv = reference_shallow_rows(engine, p, depth)
    assert r.recomputed_rows == [n_ctx] * depth + [0] * (engine.cfg.num_layers - depth)
    assert rel_dev(r.logits, logits) < 1e-5
    for (k, v), (rk, rv) in zip(kv, r.kv):
        assert torch.allclose(k, rk, atol=1e-4) and torch.allclose(v, rv, atol=1e-4)
    full = engine.prefill(p.tokens, all_logits=False)[1]
    assert not torch.allclose(full[depth][0], r.kv[depth][0], atol=1e-3)  # stored, not recomputed


def test_a_chunk_stored_behind_this_very_prefix_is_never_picked(engine, prompts):
    """The first chunk's variant computed at the start (as an instruction's is): exact, so
    the picks go to the chunks stored behind other prefixes."""
    p = prompts[3]
    first = variant(engine, [], p.chunks[0])
    segs = p.segments()
    segs[0] = Segment(p.chunks[0], cached=True, cached_prefix=())
    source = InMemoryLayerSource({0: first.kv, **{i: p.cache[i].kv for i in range(1, len(p.chunks))}})
    lay = Layout.of(segs, engine.model_spec().fingerprint())
    q = question_reads(engine, segs, source)
    live = q.live.clone()
    picks = most_read(q, lay, 40).rows
    assert picks[0] == () and sum(map(len, picks.values())) == 40
    assert torch.equal(q.live, live)  # pass 1's outcome is read, not changed
    ref = most_read(dataclasses.replace(q, reads=q.reads.clone().index_fill_(0, lay.rows(0), -1.0)), lay, 40).rows
    assert picks == ref  # the same as if chunk 0 had never been read


def test_fresh_chunks_are_computed_once_and_hidden_from_the_question_pass(engine, prompts):
    """Chunk 1 fresh: the question pass runs the question alone (chunk 1's rows read nothing and
    cost nothing there), pass 2 computes chunk 1 in full and the question from layer 0."""
    p = prompts[4]
    segs = p.segments()
    segs[1] = Segment(p.chunks[1])
    source = InMemoryLayerSource({i: p.cache[i].kv for i in (0, 2, 3)})
    lay = Layout.of(segs, engine.model_spec().fingerprint())
    L, qn, fresh = engine.cfg.num_layers, len(p.question), len(p.chunks[1])
    q = question_reads(engine, segs, source)
    assert q.result.computed_rows == [qn] * (L - 1) and q.layer0 is None
    assert float(q.reads[lay.rows(1)].abs().sum()) == 0.0
    pol = Policy("query", budget=0.3)
    r = blend_prefill(engine, segs, pol, InMemoryLayerSource(source.kv), gate=TRUSTED)
    picks = picks_budget(pol, lay, len(p.tokens) - qn - fresh, L)
    assert picks > 0
    assert sum(r.computed_rows) == qn * (L - 1) + (qn + fresh + picks) * L
    assert 1 in r.fresh  # its new variant, as with any policy


def test_chunks_all_stored_behind_their_very_prefix_are_served_exactly(engine):
    """Nothing to pick: every reused chunk is exact (a prefix-cache hit), so the prefill is
    the full prefill's, question and all."""
    p = make_prompt(engine, 7, behind="same")
    r = blend_prefill(engine, p.segments(), Policy("query", budget=0.3), p.source(), gate=TRUSTED)
    assert r.recomputed_rows == [0] * engine.cfg.num_layers
    assert rel_dev(r.logits, engine.prefill(p.tokens, all_logits=False)[0][-1]) < 1e-5


def _worked_example_reads() -> tuple:
    """Chunk A (rows 0-5) and chunk B (rows 6-10), both stored behind another prefix, then a
    2-row question; the question read row 3 most, then 8, then 10, the rest little."""
    segs = [Segment(range(6), cached=True, cached_prefix=("other",)),
            Segment(range(10, 15), cached=True, cached_prefix=("other",)), Segment((20, 21), question=True)]
    lay = Layout.of(segs, "model")
    reads = torch.tensor([0.01, 0.02, 0.03, 0.9, 0.04, 0.05, 0.06, 0.07, 0.8, 0.08, 0.5, 3.0, 2.0])
    live = torch.tensor([True] * 11 + [False] * 2)
    result = type("Pass1", (), {"reused_segments": [0, 1]})()
    return QuestionReads(reads, live, result, None), lay


@pytest.mark.parametrize("n, heads, expect", [
    (6, False, {0: (3,), 1: (0, 1, 2, 3, 4)}),  # the 6 most-read rows: 3, 8, 10, 9, 7, 6
    # row 3, then its head (3 more rows, 2 left); row 8's head (3) and 10's (5) do not fit, row
    # 9's (4) neither; row 7's (rows 6-7, 2) does
    (6, True, {0: (0, 1, 2, 3), 1: (0, 1)}),
    # row 3 and its head (4 left), row 8's (rows 6-8: 1 left), row 10's (2) does not fit, row 9
    # extends B's head by 1
    (8, True, {0: (0, 1, 2, 3), 1: (0, 1, 2, 3)}),
    # heads of rows 3 (7 left) and 8 (4 left); row 10 extends B's head by 2 (2 left), rows 9, 7
    # and 6 are in it already; row 5 extends A's head by 2 (rows 4-5): every row picked
    (11, True, {0: (0, 1, 2, 3, 4, 5), 1: (0, 1, 2, 3, 4)}),
    # row 3 and its head (1 left); of the heads after it only row 6's fits: B's first row, alone
    (5, True, {0: (0, 1, 2, 3), 1: (0,)}),
    # row 3 first, alone (2 left); its head (3 more rows) does not fit, nor row 8's (3) or 10's
    # (5) or 9's (4); row 7's does (rows 6-7)
    (3, True, {0: (3,), 1: (0, 1)}),
])
def test_picks_with_chunk_heads_follow_the_worked_example(n, heads, expect):
    q, lay = _worked_example_reads()
    got = most_read(q, lay, n, heads=heads)
    assert got.rows == expect and len(got.shallow) == 0


@pytest.mark.parametrize("n, rows, shallow", [
    # 24 row-layers of a 4-layer model, head rows through layers 0-1 (2 row-layers each): row 3
    # (4), its head rows 0-2 (6: 14 left), row 8 with rows 6-7 (4 + 4: 6 left), row 10 with
    # row 9 (4 + 2: 0 left)
    (6, {0: (0, 1, 2, 3), 1: (0, 1, 2, 3, 4)}, [0, 1, 2, 6, 7, 9]),
    # 12: row 3 (4), rows 0-2 (6: 2 left); no other head fits (row 7's: 4 + 2); row 2, the
    # most-read head row, through every layer (2 more: 0 left)
    (3, {0: (0, 1, 2, 3), 1: ()}, [0, 1]),
])
def test_head_rows_through_half_the_layers_follow_the_worked_example(n, rows, shallow):
    q, lay = _worked_example_reads()
    got = most_read(q, lay, n, heads=True, num_layers=4, depth=2)
    assert got.rows == rows and got.shallow.tolist() == shallow and got.depth == 2


@torch.no_grad()
def reference_deviation(engine, p) -> torch.Tensor:
    """[context rows] CacheBlend's |K - K'| + |V - V'| (summed over heads and dims) at layer 1
    between full prefill's K/V and each chunk's stored K/V, K rotated to the chunk's rows."""
    _, kv = engine.prefill(torch.as_tensor(p.tokens), all_logits=False)
    starts = [sum(map(len, p.chunks[:i])) for i in range(len(p.chunks))]
    stored = [p.cache[i].kv[1] for i in range(len(p.chunks))]
    K = torch.cat([apply_rope(k, torch.arange(s, s + k.shape[1]), engine.rope) for (k, _), s in zip(stored, starts)], 1)
    V = torch.cat([v for _, v in stored], 1)
    n_ctx = K.shape[1]
    return (kv[1][0][:, :n_ctx] - K).abs().sum((0, 2)) + (kv[1][1][:, :n_ctx] - V).abs().sum((0, 2))


def test_the_joined_selection_measures_the_stored_kvs_deviation_at_layer_1(engine, prompts):
    """The question pass with the deviation on runs layer 0 of every reused row: their layer-1
    K/V are full prefill's (layer-0 K/V do not depend on the prefix), so the deviation it
    records is the stored K/V's from full prefill's; from layer 1 only the question runs."""
    p, L = prompts[1], engine.cfg.num_layers
    q = question_reads(engine, p.segments(), p.source(), deviation=True)
    n_ctx = len(p.tokens) - len(p.question)
    assert torch.allclose(q.deviation[:n_ctx], reference_deviation(engine, p), rtol=1e-4, atol=1e-4)
    assert not q.deviation[n_ctx:].any()
    assert q.result.computed_rows == [len(p.tokens)] + [len(p.question)] * (L - 2)


def test_the_joined_selection_picks_by_deviation_and_pays_for_its_layer_0(engine, prompts):
    """Weight 1, single rows: pass 2 recomputes the rows of largest reference deviation (its
    logits equal pass 2 run with those picks), and the budget pays for the layer 0 of every
    reused row beside the question's two passes and the picks."""
    p, L = prompts[0], engine.cfg.num_layers
    policy = Policy("query", budget=0.9, deviation=1.0, heads=0)
    lay = _layout(engine, p)
    n_ctx = len(p.tokens) - len(p.question)
    n = picks_budget(policy, lay, n_ctx, L, measured=n_ctx)
    assert 0 < n < n_ctx
    r = blend_prefill(engine, p.segments(), policy, p.source(), gate=TRUSTED)
    assert r.computed_share <= policy.budget + 1e-9
    assert sum(r.computed_rows) == 2 * len(p.question) * (L - 1) + n_ctx + n * L
    top = set(reference_deviation(engine, p).topk(n).indices.tolist())
    q = question_reads(engine, p.segments(), p.source())
    rows = {s: tuple(i - lay.edges[s] for i in sorted(top) if lay.edges[s] <= i < lay.edges[s + 1])
            for s in range(len(p.chunks))}
    want = _second_pass(engine, p, q, Picks(rows, torch.tensor([], dtype=torch.long), L))
    assert torch.allclose(r.logits, want.logits, atol=1e-5, rtol=0)
    naive_reads = blend_prefill(engine, p.segments(), Policy("query", budget=0.9, heads=0), p.source(), gate=TRUSTED)
    assert not torch.allclose(r.logits, naive_reads.logits, atol=1e-5, rtol=0)  # the reads pick other rows


def test_where_the_deviation_would_take_most_of_the_budget_the_reads_alone_are_used(engine, prompts):
    p = prompts[0]
    joined = blend_prefill(engine, p.segments(), Policy("query"), p.source(), gate=TRUSTED)  # the default: joined
    reads = blend_prefill(engine, p.segments(), Policy("query", deviation=0), p.source(), gate=TRUSTED)
    assert torch.equal(joined.logits, reads.logits) and joined.computed_rows == reads.computed_rows


@pytest.mark.parametrize("options", [{}, {"deviation": 0.0}], ids=["joined", "reads_alone"])
def test_pass_2_over_the_question_pass_caches_is_bit_for_bit_its_own_merge(engine, prompts, options):
    """Pass 2 writes its rows over the question pass's merged caches (`reusable_caches`): the
    logits, the decode cache and a fresh chunk's KV are those of pass 2 merging every layer itself."""
    p = prompts[3]
    segs = p.segments()
    segs[1] = Segment(p.chunks[1])  # a fresh chunk: hidden in the question pass, computed in pass 2
    policy = Policy("query", budget=0.9, **options)
    used, reusable = [], default.reusable_caches

    def spied(q):  # noqa: ANN001, ANN202
        used.append(reusable(q))
        return used[-1]

    with mock.patch.object(default, "reusable_caches", spied):
        got = blend_prefill(engine, segs, policy, p.source(), gate=TRUSTED)
    with mock.patch.object(default, "reusable_caches", lambda q: {}):
        ref = blend_prefill(engine, segs, policy, p.source(), gate=TRUSTED)
    L = engine.cfg.num_layers
    assert sorted(used[0]) == list(range(1 if options else 2, L - 1))  # the path ran
    assert torch.equal(got.logits, ref.logits)
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(got.kv, ref.kv))
    assert all(torch.equal(k, k0) and torch.equal(v, v0)
               for (k, v), (k0, v0) in zip(got.fresh[1].kv, ref.fresh[1].kv))


def _heads_plainly(score: torch.Tensor, edges: list[int], budget: int, L: int, depth: int) -> tuple[list, list]:
    """`picks._heads`'s rule restated without its bookkeeping: every row in order of reads
    (ties to the lower row) is visited in both walks, and a head's unpicked rows are counted
    one by one."""
    reads = score.tolist()
    order = sorted((i for i in range(len(reads)) if reads[i] >= 0), key=lambda i: (-reads[i], i))
    deep, shallow = set(order[:min(1, budget // L)]), set()
    left, head_end = budget - L * len(deep), {}
    for i in order:
        s = max(t for t in range(len(edges) - 1) if edges[t] <= i)
        end = head_end.get(s, edges[s])
        if i < end:
            if i in shallow and left >= L - depth:
                shallow.discard(i)
                deep.add(i)
                left -= L - depth
            continue
        cost = depth * sum(1 for r in range(end, i) if r not in deep) + (0 if i in deep else L)
        if cost <= left:
            left -= cost
            shallow |= {r for r in range(end, i) if r not in deep}
            deep.add(i)
            head_end[s] = i + 1
    for i in order:
        cost = L - depth if i in shallow else L
        if i not in deep and cost <= left:
            shallow.discard(i)
            deep.add(i)
            left -= cost
    return sorted(deep | shallow), sorted(shallow)


def test_the_picks_walk_equals_its_rule_restated_plainly():
    """Random prompts, reads with ties, rows that are not candidates, every budget from none to
    all, head depths up to every layer: the picks and head rows of `picks._heads` (which stops
    its walks once nothing more fits) are those of the rule walked in full."""
    rng = torch.Generator().manual_seed(0)
    for trial in range(150):
        lens = torch.randint(1, 40, (int(torch.randint(1, 6, (1,), generator=rng)),), generator=rng).tolist()
        L = [2, 4, 8, 30][trial % 4]
        depth = int(torch.randint(1, L + 1, (1,), generator=rng))
        segs = [Segment(range(n), cached=True, cached_prefix=("other",)) for n in lens]
        segs.append(Segment((1, 2), question=True))
        lay = Layout.of(segs, "model")
        score = torch.rand(lay.n, generator=rng) ** 4
        if trial % 3 == 0:
            score = (score * 4).round() / 4  # ties
        score[torch.rand(lay.n, generator=rng) < 0.2] = -1.0
        score[-2:] = -1.0
        budget = int(torch.randint(0, lay.n * L + 1, (1,), generator=rng))
        assert picking._heads(score, lay, budget, L, depth) == _heads_plainly(score, list(lay.edges), budget, L, depth)
