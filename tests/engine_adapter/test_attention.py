"""The one attention (engine_adapter.attention) against kvkernels' reference: the position
mask whole and in runs of rows, causal and every key, the reads a policy asks for (summed over
heads and rows, weighted rows), and a batch of prompts."""

from __future__ import annotations

import math

import pytest
import torch

from engine_adapter.attention import (ATTENTION_RUNS, CAUSAL, EVERY_KEY, RowBlocks, Visibility, attend,
                                      position_mask)
from engine_adapter.rowset import RowSets
from engine_adapter.step import Rotation
from kvkernels import KeyReads, selective_attention_reference

SCALE = 1 / math.sqrt(16)


def _attend(q, q_pos, k, v, k_pos, visible, **kw):
    return attend(q, q_pos, k, v, k_pos, visible, scale=SCALE, triton=False, **kw)


# `attend` on CPU (what a prefill's attention runs there) vs kvkernels' reference; the
# tolerances of tests/kernels/test_attention_kernel.py.
ATTEND_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
              torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 1), (12, 4)], ids=["mha", "gqa4", "gqa3"])
@pytest.mark.parametrize("R,T", [(1, 37), (13, 45), (50, 50)], ids=["one_row", "subset", "all_rows"])
def test_attend_on_cpu_with_the_callers_mask_matches_the_reference(dtype, Hq, Hkv, R, T):
    g = torch.Generator().manual_seed(R * 1000 + T + Hq + 1)
    q = torch.randn(Hq, R, 16, generator=g).to(dtype)
    k, v = (torch.randn(Hkv, T, 16, generator=g).to(dtype) for _ in range(2))
    k_pos = torch.arange(T) + 100
    q_pos = k_pos[torch.randperm(T, generator=g)[:R]]  # each row is a key too: it sees at least itself
    expected, _ = selective_attention_reference(q, q_pos, k, v, k_pos, scale=SCALE)
    got, _ = _attend(q, q_pos, k, v, k_pos, Visibility(position_mask(q_pos, k_pos, dtype)))
    assert got.dtype == dtype and got.shape == (Hq, R, 16)
    torch.testing.assert_close(got.float(), expected.float(), **ATTEND_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R", [1, 2, 9, 40])
def test_attend_on_cpu_in_runs_of_rows_matches_the_reference(dtype, R):
    # The blend's rows: sorted prompt rows, the keys at their positions, the last row computed.
    T = 60
    g = torch.Generator().manual_seed(R)
    q = torch.randn(4, R, 16, generator=g).to(dtype)
    k, v = (torch.randn(2, T, 16, generator=g).to(dtype) for _ in range(2))
    pos = torch.arange(T)
    q_pos = torch.cat((torch.randperm(T - 1, generator=g)[:R - 1].sort().values, torch.tensor([T - 1])))
    mask = position_mask(q_pos, pos, dtype)
    blocks = RowBlocks.of((q_pos + 1).tolist(), mask, 4, 16)
    assert len(blocks.sizes) == ATTENTION_RUNS and sum(blocks.sizes) == R
    expected, _ = selective_attention_reference(q, q_pos, k, v, pos, scale=SCALE)
    for _ in range(2):  # the runs' output buffer is written again by the next layer
        got, _ = _attend(q, q_pos, k, v, pos, Visibility(mask, blocks))
        assert got.dtype == dtype and got.shape == (4, R, 16)
        torch.testing.assert_close(got.float(), expected.float(), **ATTEND_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("before", [1, 7, 15])
def test_the_prompts_last_rows_read_as_causal_attention_match_the_reference(dtype, before):
    """A prefix reused and the rest computed (the prefix cache's pass): the rows set's
    visibility says so where they are at least SUFFIX_SHARE of the prompt, and the attention
    is the reference's; fewer rows keep the masked runs."""
    T = 60
    g = torch.Generator().manual_seed(before)
    pos = torch.arange(T)
    rows = RowSets(T, pos, Rotation(torch.ones(T, 8), torch.zeros(T, 8), False), [True] * T, [False] * T,
                   triton=False, heads=4, kv_heads=2, head_dim=16, dtype=dtype, causal=True, runs=True,
                   grouped=False)
    visible = rows.of(range(before, T)).step.visible
    assert visible.after == before
    assert rows.of(range(T // 2, T)).step.visible.after is None  # half the prompt: below SUFFIX_SHARE
    q = torch.randn(4, T - before, 16, generator=g).to(dtype)
    k, v = (torch.randn(2, T, 16, generator=g).to(dtype) for _ in range(2))
    expected, _ = selective_attention_reference(q, pos[before:], k, v, pos, scale=SCALE)
    got, _ = _attend(q, pos[before:], k, v, pos, visible)
    assert got.dtype == dtype and got.shape == (4, T - before, 16)
    torch.testing.assert_close(got.float(), expected.float(), **ATTEND_TOL[dtype])


def test_runs_of_rows_read_the_keys_up_to_their_last_row_cut_where_that_reads_fewest():
    # rows 0..9 then 90..99 of 100 keys (two runs): the cut between them, 10 x 10 + 10 x 100 keys
    assert ATTENTION_RUNS == 2
    rows = list(range(10)) + list(range(90, 100))
    blocks = RowBlocks.of([r + 1 for r in rows], torch.zeros(20, 100), 4, 16)
    assert blocks.sizes == (10, 10) and blocks.ends == (10,)
    assert [m.shape for m in blocks.masks] == [(10, 10), (10, 100)]


def test_attend_on_cpu_keys_out_of_position_order_and_strided_inputs():
    T = 29
    k = torch.randn(T, 2, 16).transpose(0, 1)  # [Hkv, T, D] views of [T, H, D] buffers
    v = torch.randn(T, 2, 16).transpose(0, 1)
    q = torch.randn(8, 4, 16).transpose(0, 1)
    k_pos = torch.arange(T) + 3
    q_pos = torch.tensor([31, 3, 14, 5, 21, 9, 4, 17])
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(8))
    mask = position_mask(q_pos, k_pos[perm], q.dtype)
    got, _ = _attend(q, q_pos, k[:, perm], v[:, perm], k_pos[perm], Visibility(mask))
    expected, _ = selective_attention_reference(q.contiguous(), q_pos, k.contiguous(), v.contiguous(), k_pos,
                                                scale=SCALE)
    torch.testing.assert_close(got, expected, **ATTEND_TOL[torch.float32])


def test_attend_causal_is_causal_over_every_row_and_every_key_sees_all():
    q, k, v = torch.randn(4, 40, 16), torch.randn(2, 40, 16), torch.randn(2, 40, 16)
    pos = torch.arange(40)
    expected, _ = selective_attention_reference(q, pos, k, v, pos, scale=SCALE)
    torch.testing.assert_close(_attend(q, pos, k, v, pos, CAUSAL)[0], expected, **ATTEND_TOL[torch.float32])
    last = torch.tensor([39])
    got, _ = _attend(q[:, -1:], last, k, v, pos, EVERY_KEY)
    torch.testing.assert_close(got, expected[:, -1:], **ATTEND_TOL[torch.float32])


def _reads_reference(q, q_pos, k, k_pos, weights=None):
    """Each key's softmax probability summed over heads and (weighted) rows, in float64."""
    G = q.shape[0] // k.shape[0]
    s = (q.double() @ k.double().repeat_interleave(G, 0).transpose(1, 2)) * SCALE
    p = s.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf")).softmax(-1)  # [Hq, R, T]
    if weights is not None:
        p = p * weights.double()[None, :, None]
    return p.sum((0, 1))


@pytest.mark.parametrize("visible", ["mask", "runs", "causal"])
def test_reads_are_what_the_rows_read_of_each_key_beside_the_same_output(visible):
    # the question pass's reads (every row: from the same probabilities as the output) and a
    # catch-up's (the question's rows alone, weighted), added up over two calls
    g = torch.Generator().manual_seed(3)
    T = 50
    pos = torch.arange(T)
    q_pos = pos if visible == "causal" else torch.tensor([3, 17, 30, 44, 45, 49])
    q = torch.randn(8, len(q_pos), 16, generator=g)
    k, v = torch.randn(2, T, 16, generator=g), torch.randn(2, T, 16, generator=g)
    mask = position_mask(q_pos, pos, q.dtype)
    how = {"mask": Visibility(mask, None, mask.repeat(4, 1)), "causal": CAUSAL,
           "runs": Visibility(mask, RowBlocks.of((q_pos + 1).tolist(), mask, 8, 16))}[visible]
    expected, _ = selective_attention_reference(q, q_pos, k, v, pos, scale=SCALE)
    weights = (q_pos % 2 == 1).float()
    reads = KeyReads(T + 5)  # a bucket's: more keys than the prompt's
    for w in (None, weights):
        got, _ = _attend(q, q_pos, k, v, pos, how, reads=reads, reads_rows=w)
        torch.testing.assert_close(got, expected, **ATTEND_TOL[torch.float32])
    want = _reads_reference(q, q_pos, k, pos) + _reads_reference(q, q_pos, k, pos, weights)
    torch.testing.assert_close(reads.total()[:T].double(), want, atol=1e-5, rtol=1e-5)
    assert reads.total()[T:].abs().max() == 0


def test_a_batch_of_prompts_attends_as_each_prompt_alone():
    # observe's and learned's batches: leading dims, a mask per prompt broadcast over the heads
    g = torch.Generator().manual_seed(4)
    B, T = 3, 20
    q = torch.randn(B, 4, T, 16, generator=g)
    k, v = torch.randn(B, 2, T, 16, generator=g), torch.randn(B, 2, T, 16, generator=g)
    pos = torch.arange(T)
    masks = torch.stack([position_mask(pos - b, pos, q.dtype) for b in range(B)])  # prompt b sees b keys fewer
    masks[:, :, 0] = 0.0  # every row sees key 0
    weights = torch.rand(B, T, generator=g)
    reads = KeyReads(T)
    sums = torch.zeros(B, T)

    class PerPrompt:
        def add(self, x):
            sums.add_(x)

    got, _ = _attend(q, pos, k, v, pos, Visibility(masks), reads=PerPrompt(), reads_rows=weights)
    for b in range(B):
        alone, _ = _attend(q[b], pos, k[b], v[b], pos, Visibility(masks[b]), reads=reads, reads_rows=weights[b])
        torch.testing.assert_close(got[b], alone, **ATTEND_TOL[torch.float32])
        torch.testing.assert_close(sums[b], reads.total(), atol=1e-5, rtol=1e-5)
        reads.clear()
