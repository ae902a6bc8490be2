"""The policies that compute what full prefill computes: `full` (no reuse: every row at every
layer; the ground truth, and how new chunks get their variants and statistics) and `prefix`
(a prefix cache: only the leading run of chunks whose variant was computed behind exactly the
chunks before it, which is exact, nothing recomputed)."""

from __future__ import annotations

from dataclasses import dataclass

from engine_adapter.policies.base import ReusePolicy
from engine_adapter.prompt import Layout


@dataclass(frozen=True)
class Full(ReusePolicy):
    name = "full"

    def reused(self, layout: Layout) -> list[int]:
        return []


@dataclass(frozen=True)
class Prefix(ReusePolicy):
    name = "prefix"

    def reused(self, layout: Layout) -> list[int]:
        run = []
        for s, seg in enumerate(layout.segments):
            if not (seg.cached and seg.cached_prefix == layout.keys[:s]):
                break
            run.append(s)
        return run


__all__ = ["Full", "Prefix"]
