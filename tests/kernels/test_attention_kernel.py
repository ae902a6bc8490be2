"""Selective attention: reference vs SDPA and vs a naive softmax, Triton vs reference,
attention mass alone vs a naive softmax. (The CPU prefill's fused-SDPA path,
`LlamaEngine.attend`, vs the reference: tests/engine_adapter/test_llama_engine.py.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvkernels import (
    KeyReads,
    attention_mass_reference,
    selective_attention_reference,
    selective_attention_triton,
)

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
}
MASS_TOL = dict(atol=2e-6, rtol=1e-5)


def _qkv(Hq: int, Hkv: int, R: int, T: int, D: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(Hq, R, D, generator=g).to(dtype)
    k = torch.randn(Hkv, T, D, generator=g).to(dtype)
    v = torch.randn(Hkv, T, D, generator=g).to(dtype)
    return q, k, v


def _sdpa_full_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    G = q.shape[0] // k.shape[0]
    return F.scaled_dot_product_attention(
        q[None], k.repeat_interleave(G, dim=0)[None], v.repeat_interleave(G, dim=0)[None], is_causal=True
    )[0]


def _naive_mass(q, q_pos, k, k_pos, segments, scale) -> torch.Tensor:
    """Softmax the slow way, in float64, one (head, row) at a time."""
    Hq, R, _ = q.shape
    G = Hq // k.shape[0]
    bounds = segments.tolist()
    mass = torch.zeros(R, len(bounds) - 1, dtype=torch.float64)
    for h in range(Hq):
        for r in range(R):
            visible = [j for j in range(k.shape[1]) if k_pos[j] <= q_pos[r]]
            if not visible:
                continue
            logits = {j: float(q[h, r].double() @ k[h // G, j].double()) * scale for j in visible}
            top = max(logits.values())
            weights = {j: math.exp(s - top) for j, s in logits.items()}
            total = sum(weights.values())
            for s in range(len(bounds) - 1):
                mass[r, s] += sum(w for j, w in weights.items() if bounds[s] <= j < bounds[s + 1]) / total / Hq
    return mass.float()


@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 1), (8, 1)])
def test_reference_all_rows_equals_sdpa_causal(Hq: int, Hkv: int) -> None:
    q, k, v = _qkv(Hq, Hkv, 33, 33, 16, torch.float32, seed=Hq)
    pos = torch.arange(33)
    out, mass = selective_attention_reference(q, pos, k, v, pos)
    assert mass is None
    torch.testing.assert_close(out, _sdpa_full_causal(q, k, v), **TOL[torch.float32])


def test_reference_row_subset_equals_rows_of_full_sdpa() -> None:
    T, D = 41, 32
    q_all, k, v = _qkv(8, 2, T, T, D, torch.float32, seed=5)
    rows = torch.randperm(T, generator=torch.Generator().manual_seed(5))[:9]  # random order
    full = _sdpa_full_causal(q_all, k, v)
    out, _ = selective_attention_reference(q_all[:, rows], rows, k, v, torch.arange(T))
    torch.testing.assert_close(out, full[:, rows], **TOL[torch.float32])


def test_reference_mass_equals_naive_softmax() -> None:
    T, D = 19, 16
    q, k, v = _qkv(4, 2, 6, T, D, torch.float32, seed=6)
    q_pos = torch.tensor([18, 0, 7, 12, 3, 18])
    k_pos = torch.arange(T)
    segments = torch.tensor([0, 5, 5, 11, 19])  # includes an empty chunk
    _, mass = selective_attention_reference(q, q_pos, k, v, k_pos, segments=segments)
    expected = _naive_mass(q, q_pos, k, k_pos, segments, 1 / math.sqrt(D))
    torch.testing.assert_close(mass, expected, **MASS_TOL)
    assert mass[1, 0] == pytest.approx(1.0)  # row at position 0 sees only key 0
    assert torch.all(mass[:, 1] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 1), (8, 1)], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("R,T", [(1, 37), (13, 45), (50, 50)], ids=["one_row", "subset", "all_rows"])
def test_triton_matches_reference(dtype: torch.dtype, Hq: int, Hkv: int, R: int, T: int) -> None:
    seed = R * 1000 + T + Hq
    q, k, v = _qkv(Hq, Hkv, R, T, 32, dtype, seed)
    k_pos = torch.arange(T) + 100
    q_pos = k_pos[torch.randperm(T, generator=torch.Generator().manual_seed(seed))[:R]]
    segments = torch.tensor([0, 7, 7, T // 2, T])
    expected, expected_mass = selective_attention_reference(q, q_pos, k, v, k_pos, segments=segments)
    got, mass = selective_attention_triton(q, q_pos, k, v, k_pos, segments=segments)
    assert got.dtype == dtype and mass.dtype == torch.float32 and mass.shape == (R, 4)
    torch.testing.assert_close(got.float(), expected.float(), **TOL[dtype])
    torch.testing.assert_close(mass, expected_mass, **MASS_TOL)
    torch.testing.assert_close(mass.sum(dim=1), torch.ones(R), **MASS_TOL)


def test_triton_without_segments_returns_no_mass_and_sdpa_rows() -> None:
    q_all, k, v = _qkv(4, 2, 20, 20, 16, torch.float32, seed=7)
    rows = torch.tensor([19, 3, 8, 0, 11])
    out, mass = selective_attention_triton(q_all[:, rows], rows, k, v, torch.arange(20))
    assert mass is None
    torch.testing.assert_close(out, _sdpa_full_causal(q_all, k, v)[:, rows], **TOL[torch.float32])


def test_triton_keys_out_of_position_order_and_odd_head_dim() -> None:
    # The mask is by position, not by key index: a shuffled cache gives the same output,
    # and a non-power-of-two head dim is padded inside the kernel.
    T, D = 29, 24
    q, k, v = _qkv(4, 2, 8, T, D, torch.float32, seed=8)
    k_pos = torch.arange(T)
    q_pos = torch.tensor([28, 0, 14, 5, 21, 9, 2, 17])
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(8))
    got, _ = selective_attention_triton(q, q_pos, k[:, perm], v[:, perm], k_pos[perm])
    expected, _ = selective_attention_reference(q, q_pos, k, v, k_pos)
    torch.testing.assert_close(got, expected, **TOL[torch.float32])


def test_triton_strided_inputs_and_custom_scale() -> None:
    T, D = 27, 32
    k = torch.randn(T, 2, D).transpose(0, 1)  # [Hkv, T, D] views of [T, H, D] buffers
    v = torch.randn(T, 2, D).transpose(0, 1)
    q = torch.randn(6, 4, D).transpose(0, 1)
    pos = torch.arange(T)
    q_pos = torch.tensor([26, 1, 13, 20, 7, 26])
    got, mass = selective_attention_triton(q, q_pos, k, v, pos, scale=0.3, segments=torch.tensor([0, 10, T]))
    expected, expected_mass = selective_attention_reference(
        q.contiguous(), q_pos, k.contiguous(), v.contiguous(), pos, scale=0.3, segments=torch.tensor([0, 10, T])
    )
    torch.testing.assert_close(got, expected, **TOL[torch.float32])
    torch.testing.assert_close(mass, expected_mass, **MASS_TOL)


@pytest.mark.parametrize("impl", [selective_attention_reference, selective_attention_triton], ids=["reference", "triton"])
def test_row_that_sees_no_key_outputs_zero(impl) -> None:
    q, k, v = _qkv(2, 1, 2, 18, 16, torch.float32, seed=9)
    k_pos = torch.arange(18) + 10
    q_pos = torch.tensor([5, 20])  # row 0 precedes every key
    out, mass = impl(q, q_pos, k, v, k_pos, segments=torch.tensor([0, 9, 18]))
    assert torch.all(out[:, 0] == 0) and torch.all(mass[0] == 0)
    assert torch.isfinite(out).all() and mass[1].sum().item() == pytest.approx(1.0, abs=1e-6)


def test_rejects_bad_segments_and_head_ratio() -> None:
    q, k, v = _qkv(3, 2, 2, 8, 16, torch.float32, seed=10)
    pos = torch.arange(8)
    with pytest.raises(ValueError, match="multiple"):
        selective_attention_reference(q, pos[:2], k, v, pos)
    q, k, v = _qkv(2, 2, 2, 8, 16, torch.float32, seed=10)
    with pytest.raises(ValueError, match="segments"):
        selective_attention_triton(q, pos[:2], k, v, pos, segments=torch.tensor([0, 5, 7]))


def test_attention_mass_in_blocks_over_position_ordered_keys_equals_the_reference() -> None:
    from kvkernels import attention_mass, attention_mass_blocked
    from kvkernels.attention import MASS_BLOCK_ROWS

    T, D, R = 400, 16, 2 * MASS_BLOCK_ROWS + 9
    q, k, _ = _qkv(6, 3, R, T, D, torch.float32, seed=13)
    k_pos = torch.arange(T)
    q_pos = torch.randint(0, T + 5, (R,), generator=torch.Generator().manual_seed(14))
    q_pos[:MASS_BLOCK_ROWS + 3] = torch.arange(MASS_BLOCK_ROWS + 3) % 40  # a whole block sees few keys
    segments = torch.tensor([0, 30, 30, 190, T])
    expected = attention_mass_reference(q, q_pos, k, k_pos, segments, scale=0.25)
    for got in (attention_mass_blocked(q, q_pos, k, k_pos, segments, scale=0.25),
                attention_mass(q, q_pos, k, k_pos, segments, scale=0.25)):
        torch.testing.assert_close(got, expected, **MASS_TOL)


def test_attention_mass_alone_equals_naive_softmax() -> None:
    T, D = 19, 16
    q, k, _ = _qkv(4, 2, 6, T, D, torch.float32, seed=6)
    q_pos = torch.tensor([18, 0, 7, 12, 3, 18])
    k_pos = torch.arange(T)
    segments = torch.tensor([0, 5, 5, 11, 19])
    mass = attention_mass_reference(q, q_pos, k, k_pos, segments, scale=1 / math.sqrt(D))
    torch.testing.assert_close(mass, _naive_mass(q, q_pos, k, k_pos, segments, 1 / math.sqrt(D)), **MASS_TOL)


def _naive_reads(q, q_pos, k, k_pos, scale) -> torch.Tensor:
    """[T] every key's softmax probability summed over heads and rows, in float64."""
    G = q.shape[0] // k.shape[0]
    s = torch.einsum("hrd,htd->hrt", q.double(), k.repeat_interleave(G, 0).double()) * scale
    s = s.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    p = s.softmax(-1).nan_to_num(0.0)  # a row that sees no key reads nothing
    return p.sum((0, 1)).float()


@pytest.mark.parametrize("dtype,R", [(torch.float32, 1), (torch.bfloat16, 21), (torch.float32, 40)],
                         ids=["one_row", "two_blocks_bf16", "three_blocks"])
def test_triton_reads_equal_a_naive_softmax_summed_over_heads_rows_and_calls(dtype: torch.dtype, R: int) -> None:
    """The question phase's reads, added up inside the attention's launches (`KeyReads`):
    two calls (two layers), the second with fewer rows (another program count), summed once."""
    T = 45
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    k_pos = torch.arange(T)
    k_pos[30:36] = T  # hidden keys (a fresh chunk the question phase leaves out): after every row
    reads, want = KeyReads(T), torch.zeros(T)
    for call, rows in enumerate((R, max(1, R - 17))):
        q, k, v = _qkv(8, 2, rows, T, 32, dtype, seed=R * 10 + call)
        q_pos = torch.arange(T - rows, T)
        q_pos[0] = 3  # a row early in the prompt sees few keys
        out, mass = selective_attention_triton(q, q_pos, k, v, k_pos, reads=reads)
        assert mass is None
        torch.testing.assert_close(out.float(), selective_attention_reference(q, q_pos, k, v, k_pos)[0].float(),
                                   **TOL[dtype])
        want += _naive_reads(q.float(), q_pos, k.float(), k_pos, 1 / math.sqrt(32))
    got = reads.total()
    torch.testing.assert_close(got, want, **tol)
    assert torch.all(got[30:36] == 0)  # hidden keys are read by no row
    # each row's probabilities sum to 1, in each head
    torch.testing.assert_close(got.sum(), torch.tensor(float(8 * (R + max(1, R - 17)))))


def test_reads_must_count_the_caches_keys_at_least() -> None:
    q, k, v = _qkv(2, 1, 2, 8, 16, torch.float32, seed=11)
    pos = torch.arange(8)
    with pytest.raises(ValueError, match="reads counts 7 keys"):
        selective_attention_triton(q, pos[:2], k, v, pos, reads=KeyReads(7))


def test_reads_with_room_for_more_keys_add_into_the_first_and_clear_in_place() -> None:
    # A bucket's reads (engine_adapter.graphs) count its tokens; a layer over a prompt's
    # cache of fewer keys adds into the first of them.
    q, k, v = _qkv(4, 2, 20, 30, 16, torch.float32, seed=12)
    q_pos, k_pos = torch.arange(10, 30), torch.arange(30)
    roomy, exact = KeyReads(45), KeyReads(30)
    for reads in (roomy, exact):
        selective_attention_triton(q, q_pos, k, v, k_pos, reads=reads)
    got = roomy.total()
    torch.testing.assert_close(got[:30], _naive_reads(q, q_pos, k, k_pos, 1 / math.sqrt(16)), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[:30], exact.total(), atol=1e-6, rtol=1e-6)  # the same adds, summed apart
    assert not got[30:].any()
    buffers = [b.data_ptr() for b in roomy._by_programs.values()]
    roomy.clear()
    assert not roomy.total().any() and [b.data_ptr() for b in roomy._by_programs.values()] == buffers
