"""The policies that compute what full prefill computes: `full` (no reuse: every row at every
layer; the ground truth, and how new chunks get their variants and statistics) and `prefix`
(a prefix cache: only the leading run of chunks whose variant was computed behind exactly the
chunks before it, which is exact, nothing recomputed). `PrefixOf` is an adaptive policy at
recompute budget 1: the prefix cache, under that policy's name."""

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


@dataclass(frozen=True)
class PrefixOf(Prefix):
    """The adaptive policy `of` at the fidelity controller's budget 1 (`policy.with_budget`):
    the prefix cache's exact reuse, named as `of`, so that the shadows' samples of it count at
    budget 1 of that policy (the controller leaves even this reuse when they disagree)."""

    of: str = "query"

    @property
    def name(self) -> str:  # type: ignore[override] - the policy whose budget it spends
        return self.of


__all__ = ["Full", "Prefix", "PrefixOf"]
