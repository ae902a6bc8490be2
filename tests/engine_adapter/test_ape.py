"""APE's query attention (`policies.ape`, `attention.rescaled_attention`) against APE's own
formulation written out here: the keys in three groups (the shared prefix, the chunks encoded
in parallel, the query), each group's softmax and log-sum-exp, the chunks' logits divided by
the temperature T and their log-sum-exp taken as T lse + log S, the three outputs combined by
the softmax of the groups' log-sum-exps (the paper's query attention, ICLR 2025), in float64."""

from __future__ import annotations

import math

import pytest
import torch

from engine_adapter.attention import RescaledRows, position_mask, rescaled_attention
from engine_adapter.blend import blend_prefill
from engine_adapter.generate import greedy
from engine_adapter.llama import LlamaConfig, LlamaEngine
from engine_adapter.policy import Policy, parse_policy
from engine_adapter.probe import TRUSTED
from engine_adapter.prompt import Layout
from engine_adapter.selection import Rescale
from engine_adapter.source import InMemoryLayerSource
from tests.engine_adapter.adapter_helpers import make_prompt


def _ape_three_groups(q, K, V, q_pos, k_pos, prefix: int, chunks: int, t: float, s: float, scale: float):
    """APE's query attention for one head: q [R, D] over K, V [T, D], keys [0, prefix) the
    prefix, [prefix, chunks) the chunks, the rest the query's; causal by position."""
    q, K, V = q.double(), K.double(), V.double()
    logits = (q @ K.T) * scale + position_mask(q_pos, k_pos, torch.float64)
    groups = [(slice(0, prefix), 1.0, 0.0), (slice(prefix, chunks), t, math.log(s)), (slice(chunks, None), 1.0, 0.0)]
    lses, outs = [], []
    for span, temp, log_s in groups:
        g = logits[:, span] / temp
        lse = torch.logsumexp(g, -1)
        outs.append(torch.nan_to_num(torch.softmax(g, -1)) @ V[span])  # a group a row cannot see: no weight
        lses.append(lse * temp + log_s)
    weights = torch.softmax(torch.stack(lses, -1), -1)  # [R, 3]
    return sum(weights[:, i:i + 1] * outs[i] for i in range(3))


@pytest.mark.parametrize("t, s", [(0.9, 1.0), (0.5, 0.8), (1.0, 1.2), (1.0, 1.0)])
def test_rescaled_attention_is_apes_three_group_softmax(t: float, s: float):
    g = torch.Generator().manual_seed(0)
    Hq, Hkv, D, T = 4, 2, 8, 30
    prefix, chunks = 6, 22  # keys 6..21 are the chunks'
    q = torch.randn(Hq, 5, D, generator=g)
    K, V = torch.randn(Hkv, T, D, generator=g), torch.randn(Hkv, T, D, generator=g)
    k_pos = torch.arange(T)
    q_pos = torch.tensor([3, 22, 25, 27, 29])  # the first sees no chunk key: it reads as usual
    keys = torch.zeros(T, dtype=torch.bool)
    keys[prefix:chunks] = True
    rows = RescaledRows.of(Rescale(t, s, keys), q_pos, q_pos, k_pos, Hq // Hkv)
    got = rescaled_attention(q, K, V, rows, 0.3)
    for h in range(Hq):
        want = _ape_three_groups(q[h], K[h // 2], V[h // 2], q_pos, k_pos, prefix, chunks, t, s, 0.3)
        torch.testing.assert_close(got[h].double(), want, rtol=1e-5, atol=1e-5)
    if t == s == 1.0:  # plain attention
        plain = torch.nn.functional.scaled_dot_product_attention(
            q[None], K[None], V[None], attn_mask=position_mask(q_pos, k_pos, q.dtype), scale=0.3, enable_gqa=True)[0]
        torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)


def _engine() -> LlamaEngine:
    return LlamaEngine.random(LlamaConfig.named("tiny"), seed=0, std=0.1)


def test_ape_changes_only_the_questions_rows_and_is_naive_reuse_at_t_and_s_one():
    engine = _engine()
    p = make_prompt(engine, seed=3, n_chunks=3, chunk_len=12, question_len=5)
    source = lambda: InMemoryLayerSource({i: v.kv for i, v in p.cache.items()})  # noqa: E731
    naive = blend_prefill(engine, p.segments(), Policy("naive"), source(), gate=TRUSTED, stats=False)
    plain = blend_prefill(engine, p.segments(), Policy("ape", temperature=1.0), source(), gate=TRUSTED, stats=False)
    ape = blend_prefill(engine, p.segments(), Policy("ape", temperature=0.5, scale=0.8), source(), gate=TRUSTED,
                        stats=False)
    torch.testing.assert_close(plain.logits, naive.logits, rtol=1e-5, atol=1e-5)
    assert (ape.logits - naive.logits).abs().max() > 1e-3  # the question read the chunks otherwise
    n, q0 = p.tokens.shape[0], p.tokens.shape[0] - len(p.question)
    for layer, ((k, v), (nk, nv)) in enumerate(zip(ape.kv, naive.kv)):
        # the chunks' rows are served as stored: the same; the question's first row's K/V at
        # layer 0 come from its embedding alone; every later layer's from a rescaled read
        torch.testing.assert_close(k[:, :q0], nk[:, :q0])
        if layer > 0:
            assert (k[:, q0:n] - nk[:, q0:n]).abs().max() > 0


def test_greedy_decode_reads_with_the_rescale_and_ape_at_one_is_plain_decode():
    engine = _engine()
    p = make_prompt(engine, seed=4, n_chunks=3, chunk_len=12, question_len=5)
    source = InMemoryLayerSource({i: v.kv for i, v in p.cache.items()})
    policy = Policy("ape", temperature=0.3, scale=2.0)
    done = blend_prefill(engine, p.segments(), policy, source, gate=TRUSTED, stats=False)
    lay = Layout.of(p.segments(), engine.model_spec().fingerprint())
    plain = greedy(engine, done.logits, done.kv, 6)
    same = greedy(engine, done.logits, done.kv, 6, rescale=Policy("ape", temperature=1.0).rescale(lay))
    ape = greedy(engine, done.logits, done.kv, 6, rescale=policy.rescale(lay))
    assert same.tokens == plain.tokens
    assert ape.tokens[0] == plain.tokens[0]  # the prefill's own token
    assert ape.tokens != plain.tokens  # T = 0.3, S = 2 reads the chunks quite otherwise


def test_ape_leaves_the_prompts_first_chunk_as_the_shared_prefix():
    engine = _engine()
    p = make_prompt(engine, seed=5, n_chunks=3, chunk_len=4, question_len=2)
    lay = Layout.of(p.segments(), engine.model_spec().fingerprint())
    assert Policy("ape").rescale(lay).keys.tolist() == [False] * 4 + [True] * 8 + [False] * 2


def test_ape_options_are_checked():
    assert parse_policy("ape:temperature=0.8,scale=0.9") == Policy("ape", temperature=0.8, scale=0.9)
    for bad in ({"temperature": 0.0}, {"temperature": 1.5}, {"scale": 0.0}):
        with pytest.raises(ValueError):
            Policy("ape", **bad)
