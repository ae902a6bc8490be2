"""Token selection (engine_adapter.selection) against independent references."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from engine_adapter import selection as sel
from engine_adapter.llama import LlamaEngine
from kvkernels import apply_rope


def _kv(layers: int, t: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, t, 4, generator=g), torch.randn(2, t, 4, generator=g)) for _ in range(layers)]


def test_deviation_is_zero_for_identical_kv_and_finds_the_moved_token():
    kv = _kv(3, 6, 0)
    assert sel.kv_deviation(kv, kv).abs().max() == 0
    moved = [(k.clone(), v.clone()) for k, v in kv]
    moved[2][1][:, 4] += 5.0  # token 4's V on the last layer
    dev = sel.kv_deviation(kv, moved)
    assert int(dev.argmax()) == 4 and (dev[[0, 1, 2, 3, 5]] == 0).all()


def test_deviation_skips_layer_zero_by_default_and_matches_a_loop():
    a, b = _kv(3, 5, 1), _kv(3, 5, 2)
    want = torch.zeros(5)
    for layer in (1, 2):
        (ka, va), (kb, vb) = a[layer], b[layer]
        for t in range(5):
            d = sum(float((kb[h, t] - ka[h, t]).norm() + (vb[h, t] - va[h, t]).norm()) for h in range(2))
            scale = sum(float(ka[h, u].norm() + va[h, u].norm()) for h in range(2) for u in range(5)) / 5
            want[t] += d / scale
    assert torch.allclose(sel.kv_deviation(a, b), want, atol=1e-5)
    assert torch.allclose(sel.kv_deviation(a, b, [0]), sel.kv_deviation(a, b, [0]))
    with pytest.raises(ValueError, match="layer 1"):
        sel.kv_deviation(a, [a[0], (torch.zeros(2, 4, 4), torch.zeros(2, 4, 4)), a[2]])


def test_allocate_spends_one_budget_across_chunks():
    scores = {0: [0.1, 0.2, 0.0, 0.0], 2: [0.9, 0.0, 0.5, 0.05]}
    assert sel.allocate(scores, 0.25) == {0: (), 2: (0, 2)}  # 0.25 * 8 = 2 tokens
    assert sel.allocate(scores, 0.37) == {0: (), 2: (0, 2)}  # floor: never over the budget
    assert sel.allocate(scores, 0.0) == {0: (), 2: ()}
    # a token scored 0 cost nothing where it was measured: never chosen, whatever the budget
    assert sel.allocate(scores, 1.0) == {0: (0, 1), 2: (0, 2, 3)}
    with pytest.raises(ValueError, match="budget"):
        sel.allocate(scores, 1.5)


def test_per_chunk_takes_the_same_share_of_every_chunk_and_order_breaks_ties_by_index():
    assert sel.per_chunk({0: [0.1, 0.3, 0.2], 1: [5.0, 1.0, 1.0, 1.0, 0.0]}, 0.3) == {0: (1,), 1: (0, 1)}
    assert sel.order([1.0, 2.0, 2.0, 0.0]) == (1, 2, 0, 3)
    assert sel.merge_scores((), [1, 2]) == (1.0, 2.0)
    assert sel.merge_scores((3.0, 1.0), [1, 2]) == (3.0, 2.0)


def test_observe_matches_transformers_attention_and_the_engine_kv(tmp_path):
    LlamaEngine.random("tiny", seed=3, std=0.1).save_pretrained(tmp_path)
    engine = LlamaEngine.from_pretrained(tmp_path)
    hf = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tokens = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        att = hf(tokens[None], output_attentions=True).attentions  # per layer [1, Hq, T, T]
    want = sum(a[0, :, 18:24, 6:14].mean(0).sum(0) for a in att[1:])
    seen = sel.observe(engine, tokens.tolist(), (6, 14), (18, 24))
    assert torch.allclose(seen.received, want, atol=1e-5)
    only_last = sel.observe(engine, tokens.tolist(), (6, 14), (18, 24), layers=[-1]).received
    assert torch.allclose(only_last, att[-1][0, :, 18:24, 6:14].mean(0).sum(0), atol=1e-5)
    # The chunk's KV as the blend stores a fresh chunk (K without RoPE): un-rotate the
    # engine's own full-prefill K at the chunk's positions and compare.
    _, kv = engine.prefill(tokens)
    for layer, (k, v) in enumerate(seen.kv):
        k_full = apply_rope(kv[layer][0][:, 6:14], torch.arange(6, 14), engine.rope, inverse=True)
        assert torch.allclose(k, k_full, atol=1e-4) and torch.allclose(v, kv[layer][1][:, 6:14], atol=1e-5)


def test_learned_scores_need_both_a_move_and_a_reader():
    stored = _kv(2, 4, 0)
    moved = [(k.clone(), v.clone()) for k, v in stored]
    moved[1][0][:, 0] += 3.0  # token 0 moved but nobody reads it
    moved[1][0][:, 2] += 1.0  # token 2 moved and is read
    seen = sel.Observation(moved, torch.tensor([0.0, 1.0, 1.0, 0.0]))
    s = sel.learned_scores(stored, seen)
    assert int(s.argmax()) == 2 and s[0] == 0 and s[1] == 0 and s[3] == 0


def _tiny(tmp_path):
    LlamaEngine.random("tiny", seed=3, std=0.1).save_pretrained(tmp_path)
    return LlamaEngine.from_pretrained(tmp_path)


def test_observe_many_is_observe_per_request_in_any_batch(tmp_path):
    engine = _tiny(tmp_path)
    g = torch.Generator().manual_seed(7)
    reqs = []
    for n, m, q in ((0, 5, 3), (7, 4, 0), (3, 9, 2), (12, 3, 5)):
        toks = torch.randint(0, 256, (n + m + q,), generator=g).tolist()
        reqs.append((toks, (n, n + m), (n + m, n + m + q)))
    for batch in (1, 3, 8):
        for want, got in zip((sel.observe(engine, *r) for r in reqs), sel.observe_many(engine, reqs, batch=batch)):
            assert torch.allclose(got.received, want.received, atol=1e-5)
            assert torch.allclose(got.received_per_layer.sum(0), got.received, atol=1e-6)
            for (k1, v1), (k2, v2) in zip(want.kv, got.kv):
                assert torch.allclose(k1, k2, atol=1e-4) and torch.allclose(v1, v2, atol=1e-5)


def _hf_answer(hf, cache_kv, question, start):
    """transformers' next-token log-probs after `question` at rows start.., over a given cache."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer, (k, v) in enumerate(cache_kv):
        cache.update(k[None], v[None], layer)
    pos = torch.arange(start, start + len(question))[None]
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([question]), position_ids=pos, past_key_values=cache)
    return out.logits[0, -1].float().log_softmax(-1)


def test_fresh_gain_matches_transformers_over_the_same_caches(tmp_path):
    engine = _tiny(tmp_path)
    hf = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(11)
    cases, refs = [], []
    for n, m, q in ((4, 5, 3), (9, 3, 1), (2, 6, 4)):
        toks = torch.randint(0, 256, (n + m + q,), generator=g).tolist()
        other = torch.randint(0, 256, (5,), generator=g).tolist()
        stored = sel.observe_many(engine, [(other + toks[n:n + m], (5, 5 + m), (0, 0))])[0].kv  # behind a stranger
        seen = sel.observe_many(engine, [(toks, (n, n + m), (n + m, n + m + q))], context=True)[0]
        cases.append(sel.gain_case(seen, stored))
        # reference: the caches built by hand (stored K rotated to the chunk's rows), run by transformers
        pos = torch.arange(n, n + m)
        stale = [(torch.cat([k[:, :n], apply_rope(sk, pos, engine.rope), k[:, n + m:]], 1),
                  torch.cat([v[:, :n], sv, v[:, n + m:]], 1)) for (k, v), (sk, sv) in zip(seen.context, stored)]
        ref = _hf_answer(hf, seen.context, seen.question, n + m)
        kl = lambda lp: float((ref.exp() * (ref - lp)).sum())  # noqa: E731
        all_stale = kl(_hf_answer(hf, stale, seen.question, n + m))
        want = []
        for t in range(m):
            one = [(sk.clone(), sv.clone()) for sk, sv in stale]
            for (k, v), (ok, ov) in zip(one, seen.context):
                k[:, n + t], v[:, n + t] = ok[:, n + t], ov[:, n + t]
            want.append(max(0.0, all_stale - kl(_hf_answer(hf, one, seen.question, n + m))))
        refs.append(torch.tensor(want))
    for got in (sel.fresh_gain(engine, cases), sel.fresh_gain(engine, cases, max_elements=1)):
        for a, b in zip(got, refs):
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-3), (a, b)
    assert any(float(r.max()) > 1e-4 for r in refs)  # the check is not vacuous
    # the same chunk stored behind the same prefix: nothing is stale, nothing gains
    same = sel.GainCase(cases[0].context, cases[0].span, cases[0].question,
                        [(apply_rope(k[:, 4:9], torch.arange(4, 9), engine.rope, inverse=True), v[:, 4:9])
                         for k, v in cases[0].context])
    assert float(sel.fresh_gain(engine, [same])[0].max()) < 1e-5


def _blend_kl(engine, case, recompute):
    """KL(request's answer || answer with the chunk stale but `recompute` recomputed), by the
    adapter's own blended prefill (an implementation independent of `recompute_gain`)."""
    from engine_adapter import Policy
    from engine_adapter.blend import blend_prefill
    from engine_adapter.probe import TRUSTED
    from engine_adapter.prompt import Segment
    from engine_adapter.source import InMemoryLayerSource

    s0, s1 = case.span
    before, after = case.full[:s0], case.full[s1:]
    segs = [Segment(tuple(before)), Segment(tuple(case.tokens), cached=True, recompute=tuple(sorted(recompute)))]
    source = {1: case.stored}
    if after:  # rows after the chunk keep the request's own KV (reused as they were, not recomputed)
        segs.append(Segment(tuple(after), cached=True))
        source[2] = sel.observe_many(engine, [(case.full, (s1, len(case.full)), (0, 0))])[0].kv
    segs.append(Segment(tuple(case.question), question=True))
    got = blend_prefill(engine, segs, Policy("cachecraft"), InMemoryLayerSource(source), gate=TRUSTED)
    ref = blend_prefill(engine, [Segment(tuple(case.full)), segs[-1]], Policy("full"),
                        InMemoryLayerSource({}), gate=TRUSTED)
    p, q = ref.logits.float().log_softmax(-1), got.logits.float().log_softmax(-1)
    return float((p.exp() * (p - q)).sum())


def test_recompute_gain_is_the_greedy_repair_of_a_blended_prefill(tmp_path):
    from types import SimpleNamespace

    engine = _tiny(tmp_path)
    g = torch.Generator().manual_seed(5)
    cases = []
    for n, m, after, q in ((4, 5, 0, 3), (6, 4, 3, 2)):
        toks = torch.randint(0, 256, (n + m + after + q,), generator=g).tolist()
        other = torch.randint(0, 256, (6,), generator=g).tolist()
        stored = sel.observe_many(engine, [(other + toks[n:n + m], (6, 6 + m), (0, 0))])[0].kv
        seen = sel.observe_many(engine, [(toks, (n, n + m), (n + m + after, len(toks)))], context=True)[0]
        case = sel.gain_case(seen, stored)
        assert case.tokens == tuple(toks[n:n + m])
        cases.append((case, toks[:n + m + after]))
    for case, full in cases:
        ref = SimpleNamespace(span=case.span, tokens=case.tokens, question=case.question, stored=case.stored, full=full)
        # one round: KL with nothing and with each single token recomputed, as the blend computes it
        base, each = sel._recompute_rounds(engine, [case], [[]], 1 << 24)[0]
        assert abs(base - _blend_kl(engine, ref, [])) < 1e-4 * max(1.0, base)
        for t in range(len(case.tokens)):
            want = _blend_kl(engine, ref, [t])
            assert abs(float(each[t]) - want) < 1e-4 * max(1.0, want), (t, float(each[t]), want)
        # greedy from a given first token, 3 rounds, against the same greedy over blend KLs
        first = 1
        chosen, kls = [first], [base, _blend_kl(engine, ref, [first])]
        for _ in range(2):
            rest = [t for t in range(len(case.tokens)) if t not in chosen]
            best = min(rest, key=lambda t: _blend_kl(engine, ref, chosen + [t]))
            chosen.append(best)
            kls.append(_blend_kl(engine, ref, chosen))
        want = torch.zeros(len(case.tokens))
        for i, u in enumerate(chosen):
            want[u] = max(kls[i] - min(kls[i + 1:]), 0.0)
        got = sel.recompute_gain(engine, [case], rounds=3, first=[first], min_kl=0.0)[0]
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-3), (got, want)
        assert float(want.max()) > 1e-4  # not vacuous
    with pytest.raises(ValueError, match="tokens"):
        sel.recompute_gain(engine, [sel.GainCase(case.context, case.span, case.question, case.stored)])
