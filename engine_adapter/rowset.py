"""The rows a pass computes, as the loop keeps them: the step's `Rows` (cache rows, positions,
RoPE tables, how the attention sees the keys) with the candidates a choice may drop (the rows
of reused chunks still served from stored KV), each derived once per set of rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

from engine_adapter.attention import CAUSAL, SUFFIX_SHARE, RowBlocks, Visibility, position_mask
from engine_adapter.step import Rotation, Rows


@dataclass
class RowSet:
    step: Rows  # what the layer step computes them with
    host: tuple[int, ...] | None  # the rows on the host, where known without a read of the device
    cand: Tensor  # [C] indices into the rows of the candidates
    n_cand: int
    recomputed: int  # rows of reused chunks among them
    memo: dict = field(default_factory=dict)  # what the loop derives from them once

    @property
    def rows(self) -> Tensor:
        return self.step.rows

    def on_host(self) -> tuple[int, ...]:
        """The rows on the host: a read of the device where only it knows them (a choice made
        them there)."""
        if self.host is None:
            self.host = tuple(self.step.rows.tolist())
        return self.host


class RowSets:
    """Makes the `RowSet`s of one pass over a prompt of n tokens whose keys sit at `pos` [n]
    (their prompt positions, or past the end where the pass hides them)."""

    def __init__(self, n: int, pos: Tensor, rot: Rotation, live: list[bool], reused: list[bool], *, triton: bool,
                 heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, causal: bool, runs: bool,
                 grouped: bool, engine: Any = None):
        self.n, self.pos, self.rot, self.live, self.reused = n, pos, rot, live, reused
        self.triton, self.heads, self.kv_heads, self.head_dim, self.dtype = triton, heads, kv_heads, head_dim, dtype
        self.causal, self.runs, self.grouped = causal, runs, grouped
        self.engine = engine  # the engine's attention kernel (`LayerModel.attention`), or None

    def of(self, host: Sequence[int]) -> RowSet:
        """The rows `host` (sorted prompt rows)."""
        host = tuple(host)
        rows = torch.tensor(host, dtype=torch.long)
        cand = [i for i, r in enumerate(host) if self.live[r]]
        return RowSet(self._rows(rows, host), host, torch.tensor(cand, dtype=torch.long), len(cand),
                      sum(self.reused[r] for r in host))

    def chosen(self, before: RowSet, rows: Tensor, cand: Tensor, keep: int) -> RowSet:
        """What a choice (`step.Choice`) left of `before`: `rows` [R'] on the device, `keep` of
        its candidates, at `cand` among them."""
        return RowSet(self._rows(rows, None), None, cand, keep, before.recomputed - before.n_cand + keep)

    def _rows(self, rows: Tensor, host: tuple[int, ...] | None) -> Rows:
        return Rows(rows, rows, self.rot.at(rows), self._visible(rows, host))

    def _visible(self, rows: Tensor, host: tuple[int, ...] | None) -> "str | Visibility | None":
        """How the attention sees the keys (CPU; the Triton kernel masks by position itself):
        causal where the rows are every key in order, else the position mask, in runs of rows
        (`RowBlocks`: a run reads the keys up to its last row, which holds where no key sits
        before its own row; a pass that hides keys past the end reads them whole). Rows a
        choice made are read here: on the CPU a read of memory, not a wait for a device."""
        if self.triton:
            return None
        if self.causal and host is not None and len(host) == self.n:
            return CAUSAL
        mask = position_mask(rows, self.pos, self.dtype)
        grouped = mask.repeat(self.heads // self.kv_heads, 1) if self.grouped else None
        if self.causal and self.engine is not None:  # keys by position: the engine's kernel
            return Visibility(mask, None, grouped, runs=self.engine.runs(host or rows.tolist(), self.n))
        if self.causal and host is not None and len(host) >= SUFFIX_SHARE * self.n and host[0] + len(host) == self.n:
            return Visibility(mask, None, grouped, after=host[0])  # the prompt's last rows (a prefix reused)
        if not self.runs:
            return Visibility(mask, None, grouped)
        ends = [r + 1 for r in (host if host is not None else rows.tolist())]
        return Visibility(mask, RowBlocks.of(ends, mask, self.heads, self.head_dim), grouped)


__all__ = ["RowSet", "RowSets"]
