"""`cachecraft`: Cache-Craft's recompute lists and, with `focus_window` > 0, its Alg. 1.

The plan sends each reused chunk's top-N tokens by eq. 14's inter-attention (CFO-sized,
`kvcraft.recompute`): they run from layer 0 (`first_rows`). Alg. 1 (focused-chunk early
termination, Cache-Craft §3.4.2): while it decides, the attention returns the question rows'
mass on each chunk (eq. 15); once the set of focused chunks F* is stable over `focus_window`
layers (L*), the rows of the reused chunks out of focus stop being recomputed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from engine_adapter.policies.base import Passes, Prompt, ReusePolicy
from engine_adapter.prompt import Layout
from engine_adapter.selection import LayerView, Seen, Selection, Wants


@dataclass(frozen=True)
class CacheCraft(ReusePolicy):
    focus_window: int = 0  # Alg. 1 window w; 0 turns early termination off

    name = "cachecraft"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.focus_window < 0:
            raise ValueError(f"focus_window must be >= 0, got {self.focus_window}")

    def first_rows(self, layout: Layout, s: int) -> Sequence[int]:
        return layout.segments[s].recompute  # the plan's top-N list (eq. 14)

    def selection(self, prompt: Prompt) -> Selection:
        return Focus(prompt.layout, self.focus_window) if self.focus_window else Selection()

    def passes(self, prompt: Prompt) -> Passes:
        spec = next(super().passes(prompt))
        res = yield spec
        if isinstance(spec.selection, Focus):
            res.focused, res.focus_layer = spec.selection.tracker.focused, spec.selection.tracker.layer


class Focus(Selection):
    """Alg. 1's early termination as a selection: the question rows' mass per chunk while it
    decides (`FocusTracker`), then, at L*, the rows of the reused chunks out of F* dropped."""

    def __init__(self, layout: Layout, window: int) -> None:
        self.layout = layout
        self.tracker = FocusTracker(layout.chunk_indices(), window)
        self.chunks = torch.tensor(layout.chunk_indices(), dtype=torch.long)

    def wants(self, view: LayerView) -> Wants:
        return Wants(mass=self.tracker.active)

    def seen(self, view: LayerView, seen: Seen) -> None:
        if seen.mass is not None and self.tracker.active:  # its read of the question's attention
            self.tracker.update(view.layer, seen.mass.index_select(1, self.chunks).sum(0).tolist())

    def drop(self, view: LayerView) -> Sequence[int]:
        if self.tracker.focused is None or self.tracker.layer != view.layer:
            return ()
        last = self.layout.n - 1
        return [r for s in view.live if s not in self.tracker.focused for r in range(*self.layout.edges[s:s + 2])
                if r != last]


def focused_chunks(cinter: Sequence[float]) -> frozenset[int]:
    """Cache-Craft Alg. 1 lines 4-9: the high-valued chunks by cumulative question attention.

    Returns indices into `cinter`. The cut is where the entropy of the normalised gaps
    between sorted scores jumps most (h_{i+1} - h_i, i in [k-2]); with fewer than three
    chunks there is no cut and every chunk is focused.
    """
    k = len(cinter)
    order = sorted(range(k), key=lambda i: -cinter[i])
    if k < 3:
        return frozenset(order)
    s = [cinter[i] for i in order]
    diff = [s[i] - s[i + 1] for i in range(k - 1)]  # line 5
    total = sum(diff)
    if total <= 0:
        return frozenset(order)
    p = [d / total for d in diff]  # line 6
    h, acc = [], 0.0
    for pi in p:  # line 7: cumulative entropy
        acc -= pi * math.log(pi) if pi > 0 else 0.0
        h.append(acc)
    jumps = [h[i + 1] - h[i] for i in range(k - 2)]
    i_star = 1 + max(range(k - 2), key=lambda i: jumps[i])  # line 8, 1-based as in the paper
    return frozenset(order[:i_star])  # line 9


class FocusTracker:
    """Cache-Craft Alg. 1: cumulative question->chunk attention; decides F*, L* once stable."""

    def __init__(self, chunks: Sequence[int], window: int):
        self.chunks = list(chunks)
        self.window = window
        self.cinter = [0.0] * len(self.chunks)
        self.history: list[frozenset[int]] = []
        self.focused: frozenset[int] | None = None  # F*, segment indices
        self.layer: int | None = None  # L*, 0-based

    @property
    def active(self) -> bool:
        """Still deciding: the driver needs question->chunk attention mass this layer."""
        return self.window > 0 and self.focused is None

    def update(self, layer: int, inter: Sequence[float]) -> frozenset[int] | None:
        """Add layer `layer`'s inter(C_i, U) (eq. 15); returns F* the first time it is decided."""
        if self.focused is not None or self.window == 0:
            return None
        self.cinter = [c + x for c, x in zip(self.cinter, inter)]
        self.history.append(frozenset(self.chunks[i] for i in focused_chunks(self.cinter)))
        l1 = layer + 1  # the paper counts layers from 1
        if l1 > self.window and len(set(self.history[-self.window:])) == 1:  # line 11
            self.focused, self.layer = self.history[-1], layer
            return self.focused
        return None


__all__ = ["CacheCraft", "Focus", "FocusTracker", "focused_chunks"]
