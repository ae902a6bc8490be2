"""The ranks of a tensor-parallel engine, as a blend sees them.

At tensor parallel T each of an engine's T processes (ranks) holds 1/T of every layer's
attention heads: vLLM's QKV projection gives rank r its query heads and its KV heads
(`kv_heads`), its o-projection and MLP add the ranks' parts (an all-reduce in vLLM's own
modules). A blend on T ranks runs the same layer step on every rank, each over its heads,
and is one blend only if every rank computes the same rows: every choice made from what a
rank computed is agreed first. Those choices read sums over heads, which add across ranks:

  - CacheBlend's deviation of each candidate (§4.1: |K - K'| + |V - V'| summed over heads
    and dims, `kvkernels.kv_deviation`): `sum`;
  - the question's reads of each key (summed over query heads, `kvkernels.KeyReads`): `sum`;
  - Cache-Craft's question attention mass per chunk (a mean over heads): `mean`;
  - which reused chunks arrived intact by a layer (a chunk late on one rank is computed on
    every rank): `all_have`;

and every layer checks that the ranks hold the same rows (`same_rows`: before the layer, and
after a choice of rows within it, before vLLM's modules add the ranks' parts of them), so that
a divergence fails the blend on every rank (the engine then computes the request alone)
instead of mixing two ranks' rows in vLLM's collectives. Stored KV is whole (every KV head): a
rank reads its heads of it and a chunk it computed is gathered whole (`gather_heads`) and
stored by rank 0, so engines at any tensor parallel size, and the reference engine, reuse
each other's chunks.

What this does not cover: an error raised on one rank alone (not a disagreement on data) leaves
the others waiting in their next collective until the process group's timeout.

The collectives run on the ranks' CPU process group (gloo: exact integer sums, MIN/MAX),
small tensors but the gathered KV; every rank calls them in the same order, from the thread
that runs the blend (`vllm.worker`: the engine's own step thread at T > 1).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor


class RanksDiverged(RuntimeError):
    """The ranks of a blend disagree on what they compute; the blend is given up on every rank."""


class TensorRanks:
    """This process's place among an engine's `size` tensor-parallel ranks. `group`: a
    torch.distributed process group of the ranks on the CPU (gloo)."""

    def __init__(self, rank: int, size: int, group: Any) -> None:
        self.rank, self.size, self.group = rank, size, group

    @classmethod
    def of_vllm(cls) -> "TensorRanks | None":
        """vLLM's tensor-parallel group of this process (None at tensor parallel 1)."""
        from vllm.distributed import get_tp_group

        tp = get_tp_group()
        return None if tp.world_size == 1 else cls(tp.rank_in_group, tp.world_size, tp.cpu_group)

    def kv_heads(self, total: int) -> tuple[int, int]:
        """[start, stop) of the model's `total` KV heads this rank holds: a 1/size share, or,
        with fewer KV heads than ranks, the one head it shares with size/total ranks (vLLM's
        `QKVParallelLinear` replicates them so)."""
        if total >= self.size:
            if total % self.size:
                raise ValueError(f"{total} KV heads do not split over {self.size} tensor-parallel ranks")
            n = total // self.size
            return self.rank * n, (self.rank + 1) * n
        if self.size % total:
            raise ValueError(f"{self.size} tensor-parallel ranks do not share {total} KV heads evenly")
        h = self.rank // (self.size // total)
        return h, h + 1

    def _reduce(self, t: Tensor, op: Any) -> Tensor:
        x = t.detach().to("cpu", copy=True)
        dist.all_reduce(x, op=op, group=self.group)
        return x.to(t.device)

    def sum(self, t: Tensor) -> Tensor:
        """The ranks' `t` added (a new tensor, on t's device)."""
        return self._reduce(t, dist.ReduceOp.SUM)

    def mean(self, t: Tensor) -> Tensor:
        """The mean of the ranks' `t`: a mean over every head where each rank's is over its own."""
        return self.sum(t) / self.size

    def all_have(self, present: Sequence[bool]) -> list[bool]:
        """For each item, whether every rank has it."""
        if not present:
            return []
        got = self._reduce(torch.tensor([int(p) for p in present], dtype=torch.int64), dist.ReduceOp.MIN)
        return [bool(x) for x in got.tolist()]

    def same(self, what: str, values: Sequence[int]) -> None:
        """RanksDiverged on every rank unless every rank holds these integers."""
        x = torch.tensor(list(values), dtype=torch.int64)
        lo, hi = self._reduce(x, dist.ReduceOp.MIN), self._reduce(x, dist.ReduceOp.MAX)
        if not torch.equal(lo, hi):
            raise RanksDiverged(f"the {self.size} tensor-parallel ranks disagree on {what}: "
                                f"from {lo.tolist()} to {hi.tolist()}")

    def same_rows(self, what: str, rows: Tensor) -> None:
        """`same` for a set of rows (indices), by three integers two different sets hardly share."""
        r = rows.long()
        self.same(what, [r.numel(), int(r.sum()), int((r * r).sum())])

    def gather_heads(self, t: Tensor, total: int) -> Tensor:
        """This rank's heads [h, ...] of a KV tensor -> every rank's, [total, ...] (on the CPU)."""
        x = t.detach().to("cpu").contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        if total < self.size:  # each head held by size/total ranks: one copy of each
            parts = parts[::self.size // total]
        return torch.cat(parts, dim=0)


__all__ = ["RanksDiverged", "TensorRanks"]
