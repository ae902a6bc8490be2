"""Learned recompute lists (engine_adapter.learned) against independent references:
transformers over the same caches, the adapter's own blended prefill."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from engine_adapter import learned
from engine_adapter.llama import LlamaEngine
from engine_adapter.observe import observe_many
from kvkernels import apply_rope


def _tiny(tmp_path):
    LlamaEngine.random("tiny", seed=3, std=0.1).save_pretrained(tmp_path)
    return LlamaEngine.from_pretrained(tmp_path)


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
        stored = observe_many(engine, [(other + toks[n:n + m], (5, 5 + m), (0, 0))])[0].kv  # behind a stranger
        seen = observe_many(engine, [(toks, (n, n + m), (n + m, n + m + q))], context=True)[0]
        cases.append(learned.gain_case(seen, stored))
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
    for got in (learned.fresh_gain(engine, cases), learned.fresh_gain(engine, cases, max_elements=1)):
        for a, b in zip(got, refs):
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-3), (a, b)
    assert any(float(r.max()) > 1e-4 for r in refs)  # the check is not vacuous
    # the same chunk stored behind the same prefix: nothing is stale, nothing gains
    same = learned.GainCase(cases[0].context, cases[0].span, cases[0].question,
                        [(apply_rope(k[:, 4:9], torch.arange(4, 9), engine.rope, inverse=True), v[:, 4:9])
                         for k, v in cases[0].context])
    assert float(learned.fresh_gain(engine, [same])[0].max()) < 1e-5


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
        source[2] = observe_many(engine, [(case.full, (s1, len(case.full)), (0, 0))])[0].kv
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
        stored = observe_many(engine, [(other + toks[n:n + m], (6, 6 + m), (0, 0))])[0].kv
        seen = observe_many(engine, [(toks, (n, n + m), (n + m + after, len(toks)))], context=True)[0]
        case = learned.gain_case(seen, stored)
        assert case.tokens == tuple(toks[n:n + m])
        cases.append((case, toks[:n + m + after]))
    for case, full in cases:
        ref = SimpleNamespace(span=case.span, tokens=case.tokens, question=case.question, stored=case.stored, full=full)
        # one round: KL with nothing and with each single token recomputed, as the blend computes it
        base, each = learned._recompute_rounds(engine, [case], [[]], 1 << 24)[0]
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
        got = learned.recompute_gain(engine, [case], rounds=3, first=[first], min_kl=0.0)[0]
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-3), (got, want)
        assert float(want.max()) > 1e-4  # not vacuous
    with pytest.raises(ValueError, match="tokens"):
        learned.recompute_gain(engine, [learned.GainCase(case.context, case.span, case.question, case.stored)])
