"""Selective attention: a subset of query rows over the merged KV cache, plus per-chunk mass.

Cache-Craft §3.4.3: Q is computed only for new chunks, the question and the recompute
tokens, so Q has fewer rows than the merged K/V and "a custom attention mask is
required, replacing the standard triangular causal mask" (Fig. 4). Here the mask is
position-causal: key j is visible to query row r iff ``k_pos[j] <= q_pos[r]``, which
is the causal mask of a full prefill restricted to the computed rows, whatever order
the rows and the cache are in.

The same pass returns the attention mass each query row puts on each chunk
(``segments``: chunk spans in key order), averaged over query heads. That single
[R, S] output feeds Cache-Craft's inter/intra attention (eq. 3-4), per-token
inter-attention (eq. 14) and question->chunk attention for focused-chunk selection
(Alg. 1), with no second attention call.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._triton_util import check_launchable, dot_in_fp32, is_interpreted

_LOG2E = 1.4426950408889634


def _check(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pos: torch.Tensor,
    segments: torch.Tensor | None,
    validate: bool = True,
) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("q must be [Hq, R, D], k and v [Hkv, T, D]")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dims differ: q {q.shape[-1]}, k {k.shape[-1]}")
    if k.shape[0] == 0 or q.shape[0] % k.shape[0]:
        raise ValueError(f"query heads {q.shape[0]} must be a multiple of kv heads {k.shape[0]}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share one of fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q_pos.shape != (q.shape[1],) or k_pos.shape != (k.shape[1],):
        raise ValueError("q_pos must be [R] and k_pos [T]")
    if q_pos.dtype not in (torch.int64, torch.int32) or k_pos.dtype not in (torch.int64, torch.int32):
        raise ValueError("q_pos and k_pos must be integer tensors")
    if segments is not None:
        T = k.shape[1]
        if segments.dim() != 1 or segments.shape[0] < 2 or segments.dtype not in (torch.int64, torch.int32):
            raise ValueError("segments must be an integer tensor [S+1] with S >= 1")
        if not validate:  # the caller's own bounds: reading them would wait for the device
            return
        ok = (segments[0] == 0) & (segments[-1] == T) & (segments.diff() >= 0).all()
        if not bool(ok):
            raise ValueError(f"segments must be nondecreasing from 0 to T={T}")


def _segment_ids(segments: torch.Tensor, T: int) -> torch.Tensor:
    """Segment index of every key [T]; output_size given so CUDA needs no host sync."""
    S = segments.shape[0] - 1
    ids = torch.arange(S, device=segments.device)
    return torch.repeat_interleave(ids, segments.diff(), output_size=T)


def selective_attention_reference(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    scale: float | None = None,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain-torch selective attention. Same contract as :func:`selective_attention_triton`."""
    _check(q, q_pos, k, v, k_pos, segments)
    Hq, R, D = q.shape
    Hkv, T, _ = k.shape
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qf = q.float().view(Hkv, G, R, D)  # query head h = kv head h // G
    scores = torch.einsum("hgrd,htd->hgrt", qf, k.float()) * scale  # [Hkv, G, R, T]
    visible = k_pos[None, :] <= q_pos[:, None]  # [R, T]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees no key: all 0
    out = torch.einsum("hgrt,htd->hgrd", probs, v.float()).reshape(Hq, R, D).to(q.dtype)
    if segments is None:
        return out, None
    per_key = probs.reshape(Hq, R, T).mean(dim=0)  # [R, T], averaged over query heads
    S = segments.shape[0] - 1
    mass = torch.zeros(R, S, dtype=torch.float32, device=q.device)
    mass.index_add_(1, _segment_ids(segments, T), per_key)  # [R, S]
    return out, mass


def attention_mass_reference(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    k_pos: torch.Tensor,
    segments: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Per-segment attention mass fp32 [R, S] of query rows q [Hq, R, D] over k [Hkv, T, D]
    (the ``mass`` of :func:`selective_attention_reference`, without the output).

    For the few rows whose mass is needed (fresh chunks' statistics, the question for
    Alg. 1) beside a fast attention that returns none: scores, softmax and a segment sum.
    """
    _check(q, q_pos, k, k, k_pos, segments)
    Hq, R, D = q.shape
    Hkv, T, _ = k.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    scores = torch.matmul(q.float().reshape(Hkv, Hq // Hkv * R, D), k.float().transpose(1, 2))  # [Hkv, G*R, T]
    scores = scores.view(Hq, R, T).mul_(scale)
    scores.masked_fill_(~(k_pos[None, :] <= q_pos[:, None]), float("-inf"))
    per_key = torch.softmax(scores, dim=-1).nan_to_num_(0.0).mean(dim=0)  # [R, T], mean over heads
    mass = torch.zeros(R, segments.shape[0] - 1, dtype=torch.float32, device=q.device)
    return mass.index_add_(1, _segment_ids(segments, T), per_key)  # [R, S]


def _row_blocks(q_pos: torch.Tensor, k_pos: torch.Tensor, rows: int):  # -> Iterator[(idx, pos, t)]
    """Query rows in position order, `rows` at a time: (their indices, positions, the number
    of leading keys they can see), for keys in position order."""
    order = q_pos.argsort()
    pos = q_pos[order]
    ends = torch.searchsorted(k_pos, pos, right=True).tolist()  # [R] keys visible to each sorted row
    for a in range(0, len(order), rows):
        b = min(a + rows, len(order))
        yield order[a:b], pos[a:b], ends[b - 1]


MASS_BLOCK_ROWS = 256  # query rows per scores matrix of attention_mass_blocked


def attention_mass_blocked(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    k_pos: torch.Tensor,
    segments: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """:func:`attention_mass_reference` for keys in position order, `MASS_BLOCK_ROWS` rows at a
    time over the keys they can see: half the scores of one pass for rows spread over the
    prompt (a fresh chunk's statistics), and a scores matrix that stays in cache."""
    _check(q, q_pos, k, k, k_pos, segments)
    Hq, R, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    mass = torch.zeros(R, segments.shape[0] - 1, dtype=torch.float32, device=q.device)
    for idx, pos, t in _row_blocks(q_pos, k_pos, MASS_BLOCK_ROWS):
        if t:  # rows that see no key put no mass anywhere
            mass[idx] = attention_mass_reference(q[:, idx], pos, k[:, :t], k_pos[:t], segments.clamp(max=t),
                                                 scale=scale)
    return mass


class KeyReads:
    """How much every key was read, summed over rows, query heads and calls, accumulated by
    :func:`selective_attention_triton` inside its own launches: each program adds into its
    own row of a [programs, T] fp32 buffer (no atomics, so the same sums run to run; one
    buffer per program count, zeroed once), and :meth:`total` sums them, once, at the end.
    A call over fewer keys than `keys` adds into the first of them (a cache kept with room
    for more tokens than its prompt's, `engine_adapter.graphs`); the buffers keep their
    addresses from call to call (a CUDA graph captures them), `clear` zeroes them."""

    def __init__(self, keys: int, device: torch.device | str | None = None) -> None:
        self.keys = keys
        self.device = device
        self._by_programs: dict[int, torch.Tensor] = {}
        self._outside: dict[int, torch.Tensor] = {}  # `add`'s views, by length

    def buffer(self, programs: int) -> torch.Tensor:
        """The [programs, keys] accumulator of launches with that many programs."""
        if programs not in self._by_programs:
            self._by_programs[programs] = torch.zeros(programs, self.keys, dtype=torch.float32, device=self.device)
        return self._by_programs[programs]

    def add(self, x: torch.Tensor) -> None:
        """Add reads counted outside a launch (fp32 [T'], T' <= keys: the first T' keys)."""
        acc = self._outside.get(x.shape[-1])
        if acc is None:  # a view of one accumulator per length, made once (one launch an add)
            acc = self._outside[x.shape[-1]] = self.buffer(1)[0, :x.shape[-1]]
        acc.add_(x)

    def clear(self) -> None:
        """Every key back to unread, the buffers where they were."""
        for acc in self._by_programs.values():
            acc.zero_()

    def save(self) -> dict[int, torch.Tensor]:
        """A copy of the sums so far, for `restore`."""
        return {n: acc.clone() for n, acc in self._by_programs.items()}

    def restore(self, saved: dict[int, torch.Tensor]) -> None:
        """The sums as `save` found them (a buffer made since back to zero), in place."""
        for n, acc in self._by_programs.items():
            if n in saved:
                acc.copy_(saved[n])
            else:
                acc.zero_()

    def total(self) -> torch.Tensor:
        """fp32 [T]: every key's reads over all the calls so far."""
        out = torch.zeros(self.keys, dtype=torch.float32, device=self.device)
        for acc in self._by_programs.values():
            out += acc.sum(0)
        return out


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, qpos_ptr, kpos_ptr, out_ptr,
    seg_ptr, mass_ptr, reads_ptr,
    R, T, D, GROUP, qk_scale, S, stride_reads,
    stride_qh, stride_qr, stride_qd,
    stride_kh, stride_kt, stride_kd,
    stride_vh, stride_vt, stride_vd,
    stride_oh, stride_or, stride_od,
    HAS_SEGMENTS: tl.constexpr, HAS_READS: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program: BLOCK_R query rows of one query head, over every key block.
    h = tl.program_id(1)
    kvh = h // GROUP  # GQA: query head h reads kv head h // (Hq // Hkv)
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_r = offs_r < R
    mask_d = offs_d < D

    q = tl.load(
        q_ptr + h * stride_qh + offs_r[:, None] * stride_qr + offs_d[None, :] * stride_qd,
        mask=mask_r[:, None] & mask_d[None, :], other=0.0,
    )  # [BLOCK_R, BLOCK_D]
    if DOT_FP32:
        q = q.to(tl.float32)
    # Rows past R get position -1 and so see no key.
    qpos = tl.load(qpos_ptr + offs_r, mask=mask_r, other=-1)  # [BLOCK_R]
    k_base = k_ptr + kvh * stride_kh + offs_d[:, None] * stride_kd  # K^T tile [BLOCK_D, BLOCK_N]
    v_base = v_ptr + kvh * stride_vh + offs_d[None, :] * stride_vd  # V tile [BLOCK_N, BLOCK_D]

    # Online softmax in base 2 (scores pre-multiplied by log2 e). A finite initial max
    # keeps exp2(m_old - m_new) finite for rows that have seen no visible key yet.
    m_i = tl.full([BLOCK_R], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, T, BLOCK_N):
        cols = start_n + offs_n
        mask_n = cols < T
        kpos = tl.load(kpos_ptr + cols, mask=mask_n, other=0)
        visible = (kpos[None, :] <= qpos[:, None]) & mask_n[None, :]  # [BLOCK_R, BLOCK_N]
        kt = tl.load(k_base + cols[None, :] * stride_kt, mask=mask_d[:, None] & mask_n[None, :], other=0.0)
        vt = tl.load(v_base + cols[:, None] * stride_vt, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        if DOT_FP32:
            s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = tl.where(visible, s * qk_scale, float("-inf"))  # [BLOCK_R, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # a row that sees no key outputs 0
    out = acc / l_safe[:, None]
    tl.store(
        out_ptr + h * stride_oh + offs_r[:, None] * stride_or + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_r[:, None] & mask_d[None, :],
    )

    if HAS_SEGMENTS or HAS_READS:
        # Mass needs the final normaliser, which only exists after the last key block:
        # a second pass recomputes each score block (no V) and turns it into exact
        # probabilities p = exp2(s - m) / l. Within a key block the probabilities are
        # summed per segment the block touches (usually one or two: chunks are long
        # spans of keys). This program alone owns rows offs_r of head h in the
        # per-head buffer [Hq, R, S], so plain load-add-store suffices, no atomics; the
        # launcher averages over heads. Reads: the probabilities summed over this
        # program's rows, per key, added into its own row of a [row blocks x Hq, >= T]
        # accumulator (rows past R see no key, so add nothing); `KeyReads.total` sums it.
        inv_l = tl.where(l_i > 0.0, 1.0 / l_safe, 0.0)
        mass_base = mass_ptr + h * R * S + offs_r * S  # [BLOCK_R]
        reads_base = reads_ptr + (tl.program_id(0) * tl.num_programs(1) + h) * stride_reads
        for start_n in range(0, T, BLOCK_N):
            cols = start_n + offs_n
            mask_n = cols < T
            kpos = tl.load(kpos_ptr + cols, mask=mask_n, other=0)
            visible = (kpos[None, :] <= qpos[:, None]) & mask_n[None, :]
            kt = tl.load(k_base + cols[None, :] * stride_kt, mask=mask_d[:, None] & mask_n[None, :], other=0.0)
            if DOT_FP32:
                s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            s = tl.where(visible, s * qk_scale, float("-inf"))
            p = tl.exp2(s - m_i[:, None]) * inv_l[:, None]  # [BLOCK_R, BLOCK_N], final probabilities
            if HAS_READS:
                prev_reads = tl.load(reads_base + cols, mask=mask_n, other=0.0)
                tl.store(reads_base + cols, prev_reads + tl.sum(p, axis=0), mask=mask_n)
            if HAS_SEGMENTS:
                seg = tl.load(seg_ptr + cols, mask=mask_n, other=-1)  # [BLOCK_N]
                seg_lo = tl.load(seg_ptr + start_n)
                seg_hi = tl.load(seg_ptr + tl.minimum(start_n + BLOCK_N, T) - 1)
                for sid in range(seg_lo, seg_hi + 1):
                    part = tl.sum(tl.where(seg[None, :] == sid, p, 0.0), axis=1)  # [BLOCK_R]
                    prev = tl.load(mass_base + sid, mask=mask_r, other=0.0)
                    tl.store(mass_base + sid, prev + part, mask=mask_r)


def selective_attention_triton(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    scale: float | None = None,
    segments: torch.Tensor | None = None,
    reads: KeyReads | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of selected query rows over a merged cache, with per-segment mass (Triton).

    Args:
        q: [Hq, R, D] query rows (any subset of the prompt, any order), RoPE applied.
        q_pos: [R] integer absolute positions of those rows.
        k, v: [Hkv, T, D] merged cache (RoPE applied to k); Hq % Hkv == 0, query head
            h reads kv head h // (Hq // Hkv) (GQA).
        k_pos: [T] integer absolute positions of the keys.
        scale: score scale, default 1 / sqrt(D).
        segments: optional [S+1] integer key-index boundaries of chunks in key order,
            segments[0] == 0, segments[-1] == T, nondecreasing (empty spans allowed).
        reads: optional `KeyReads` over T keys or more (the first T are these): the softmax
            probability of each key summed over every row and query head is added into it,
            from the same launch (what the default policy's question phase records per
            layer, `engine_adapter.policies.default`).
        validate: check the segments' values (a read of the device); False where the caller
            made them so (the blend loop's `Layout.bounds`), inside a loop that must not wait.

    Key j is visible to row r iff ``k_pos[j] <= q_pos[r]``. fp16/bf16/fp32 inputs of one
    dtype, fp32 accumulation.

    Returns:
        out: [Hq, R, D] in q.dtype, a view of [R, Hq, D] memory (the o-projection reads it as
            [R, Hq*D] without a copy); a row that sees no key is 0.
        mass: fp32 [R, S] (None without segments): softmax probability summed over each
            segment's keys, averaged over the Hq query heads. A row's mass sums to 1 over
            segments that cover all its visible keys (0 for a row that sees no key).
    """
    _check(q, q_pos, k, v, k_pos, segments, validate)
    if reads is not None and reads.keys < k.shape[1]:
        raise ValueError(f"reads counts {reads.keys} keys, the cache has {k.shape[1]}")
    check_launchable(_attn_fwd_kernel, q, q_pos, k, v, k_pos)
    Hq, R, D = q.shape
    Hkv, T, _ = k.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.empty(R, Hq, D, dtype=q.dtype, device=q.device).transpose(0, 1)  # rows-major, as o-proj reads it
    if segments is not None:
        S = segments.shape[0] - 1
        seg_ids = _segment_ids(segments, T).to(torch.int32)
        mass_heads = torch.zeros(Hq, R, S, dtype=torch.float32, device=q.device)  # [Hq, R, S]
    else:
        S = 0
        seg_ids = torch.empty(0, dtype=torch.int32, device=q.device)
        mass_heads = torch.empty(0, dtype=torch.float32, device=q.device)
    if R == 0:
        return out, (mass_heads.mean(dim=0) if segments is not None else None)
    if T == 0:
        out.zero_()
        return out, (mass_heads.mean(dim=0) if segments is not None else None)

    # Small tiles in the interpreter (it is slow, cost grows with tile volume);
    # flash-attention-sized tiles on the GPU.
    block_r, block_n = (16, 16) if is_interpreted(_attn_fwd_kernel) else (64, 64)
    block_d = max(16, triton.next_power_of_2(D))
    grid = (triton.cdiv(R, block_r), Hq)
    per_program = (reads.buffer(grid[0] * Hq) if reads is not None  # [row blocks x Hq, reads.keys >= T]
                   else torch.empty(0, dtype=torch.float32, device=q.device))
    _attn_fwd_kernel[grid](
        q, k, v, q_pos, k_pos, out,
        seg_ids, mass_heads, per_program,
        R, T, D, Hq // Hkv, scale * _LOG2E, S, reads.keys if reads is not None else 0,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        HAS_SEGMENTS=segments is not None,
        HAS_READS=reads is not None,
        DOT_FP32=dot_in_fp32(_attn_fwd_kernel, q.dtype),
        BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=4,
    )
    if segments is None:
        return out, None
    return out, mass_heads.mean(dim=0)
