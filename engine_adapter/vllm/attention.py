"""vLLM's CPU attention kernel as the arithmetic of the blend's attention inside vLLM.

kvcraft decides what each computed row attends to: the layer's merged cache, every key at a
position up to the row's own (`attention.attend`). On a CPU, vLLM's own kernel
(`cpu_attention_with_kv_cache`, what vLLM's prefill runs) computes that 2-3x faster than
torch's fused SDPA (12 heads, 4 KV heads, 1,312 tokens, a layer: ~15 ms against ~40). It reads
a paged cache and takes a batch of requests, each a run of query rows that are the last
positions of its sequence; so a set of rows in position order is given as its runs of
consecutive rows, each run a request over the keys up to its last row, every request over
the same blocks: a copy of the layer's merged cache in vLLM's block layout (made per call:
under traffic glibc hands the same freed block back, and at rest none stays resident). The
result is the position-causal attention of `attention.attend`, in fp32 within ~1e-6 of
torch's (tests/vllm/test_engine_attention.py).

What the torch attention returns besides the output (the question's reads, the attention
mass) and passes that hide keys past the prompt (the default's question pass) stay on
kvcraft's own attention. On a GPU the step's Triton kernel attends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

BLOCK = 32  # tokens per block of the copy (vLLM's CPU kernels take multiples of 32)


@dataclass(frozen=True)
class Runs:
    """A set of rows in position order as vLLM's kernel takes them: its runs of consecutive
    rows as requests (made once per set of rows)."""

    query_start_loc: Tensor  # int32 [runs + 1]: where each run's rows start among the rows
    seq_lens: Tensor  # int32 [runs]: the keys each run reads (its last row + 1)
    block_table: Tensor  # int32 [runs, blocks]: every run over the same blocks
    metadata: Tensor  # vLLM's work split of these runs
    keys: int  # keys in the cache the rows attend over
    slots: Tensor  # [keys] each key's slot in the block copy
    tail: Tensor  # the last block's slots past the keys (zeroed each call: read, at weight 0)
    blank: Tensor  # [tail, Hkv, D] zeros written there


class VllmCpuAttention:
    """`attend`'s engine inside a vLLM on a CPU: `runs(rows, keys)`, then `(q, K, V, runs)`.
    `turn`: the lock vLLM's kernels take turns under in this process (`model.CPU_TURN`)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, turn: Any) -> None:
        from vllm import _custom_ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        self.ops, self.heads, self.kv_heads, self.head_dim, self.dtype = _custom_ops, heads, kv_heads, head_dim, dtype
        self.isa = _get_attn_isa(dtype, BLOCK, head_dim)
        self.turn = turn
        self._causal: dict[tuple[int, int], Runs] = {}

    def runs(self, rows: Sequence[int], keys: int) -> Runs:
        """`rows`: prompt positions, ascending, each below `keys`."""
        starts = [i for i in range(len(rows)) if i == 0 or rows[i] != rows[i - 1] + 1]
        ends = starts[1:] + [len(rows)]
        blocks = -(-keys // BLOCK)
        qsl = torch.tensor(starts + [len(rows)], dtype=torch.int32)
        seq_lens = torch.tensor([rows[e - 1] + 1 for e in ends], dtype=torch.int32)
        table = torch.arange(blocks, dtype=torch.int32).expand(len(starts), blocks).contiguous()
        with self.turn:  # (it grows vLLM's scratch pad: `model.CPU_TURN`)
            metadata = self.ops.cpu_attn_get_scheduler_metadata(
                num_reqs=len(starts), num_heads=self.heads, num_kv_heads=self.kv_heads, head_dim=self.head_dim,
                seq_lens=seq_lens, dtype=self.dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1,
                isa=self.isa, enable_kv_split=False)
        tail = torch.arange(keys, blocks * BLOCK)
        blank = torch.zeros(tail.shape[0], self.kv_heads, self.head_dim, dtype=self.dtype)
        return Runs(qsl, seq_lens, table, metadata, keys, torch.arange(keys), tail, blank)

    def causal(self, n: int) -> Runs:
        """Every row of an n-token prompt, in order (a full prefill; the last few lengths kept).
        vLLM's work split is for the calling thread's OpenMP threads (its kernel checks it): the
        step thread's team and a fidelity shadow's one thread each have their own."""
        key = (n, torch.get_num_threads())
        if key not in self._causal:
            if len(self._causal) >= 8:
                self._causal.pop(next(iter(self._causal)))
            self._causal[key] = self.runs(range(n), n)
        return self._causal[key]

    def _blocks(self, keys: int) -> tuple[Tensor, Tensor]:
        """A block copy with room for `keys`: (key blocks, value blocks) as vLLM's CPU backend
        views its cache ([blocks, Hkv, BLOCK, D] each)."""
        blocks = -(-keys // BLOCK)
        buf = torch.empty(blocks, self.kv_heads, BLOCK, 2 * self.head_dim, dtype=self.dtype)
        paged = buf.view(blocks, self.kv_heads, 2 * BLOCK, self.head_dim)
        return paged[:, :, :BLOCK], paged[:, :, BLOCK:]

    def __call__(self, q: Tensor, K: Tensor, V: Tensor, runs: Runs, scale: float) -> Tensor:
        """Rotated q [Hq, R, D] over K (rotated), V [Hkv, keys, D] -> o [Hq, R, D] (rows-major in
        memory, as the o-proj reads it)."""
        key_blocks, value_blocks = self._blocks(runs.keys)
        out = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype)
        with self.turn:
            self.ops.cpu_attn_reshape_and_cache(K.transpose(0, 1), V.transpose(0, 1), key_blocks, value_blocks,
                                                runs.slots, self.isa)
            # the kernel reads whole blocks: a number times 0 is 0, what the allocation left
            # there need not be
            self.ops.cpu_attn_reshape_and_cache(runs.blank, runs.blank, key_blocks, value_blocks, runs.tail,
                                                self.isa)
            self.ops.cpu_attention_with_kv_cache(
                query=q.transpose(0, 1), key_cache=key_blocks, value_cache=value_blocks, output=out,
                query_start_loc=runs.query_start_loc, seq_lens=runs.seq_lens, scale=scale, causal=True,
                alibi_slopes=None, sliding_window=-1, block_table=runs.block_table, softcap=0.0,
                scheduler_metadata=runs.metadata, s_aux=None)
        return out.transpose(0, 1)


__all__ = ["BLOCK", "Runs", "VllmCpuAttention"]
