"""The base of every reuse policy: what is reused, which rows run first, and its passes.

A policy is a frozen dataclass of its options (built once, from configuration: `policy.Policy`)
that answers the loop's questions:

    reused(layout)          which cached chunks are served from stored KV
    first_rows(layout, s)   which token indices of reused chunk s run from layer 0
    passes(prompt)          the passes over the layers (`selection.Pass`), as a generator that
                            receives each pass's result: one for most policies, two for the
                            default (a question pass, then the prefill it chose rows for)

and per layer, through the `selection.Selection` its pass carries, which rows run on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar, Generator, Sequence

from engine_adapter.prompt import Layout
from engine_adapter.result import BlendResult
from engine_adapter.selection import Pass, Selection


@dataclass(frozen=True)
class Prompt:
    """What a policy's passes start from: the prompt, the chunks it reuses, the model's depth."""

    layout: Layout
    reused: tuple[int, ...]
    num_layers: int
    stats: bool  # the fresh chunks' variants are wanted (their KV and statistics)

    def computed(self, reused: Sequence[int] | None = None) -> list[int]:
        """The rows every pass computes: those of no reused chunk (fresh chunks, the question)
        and the last row (`reused`: these chunks instead of the prompt's)."""
        lay = self.layout
        stored = {r for s in (self.reused if reused is None else reused) for r in range(*lay.edges[s:s + 2])}
        return sorted(set(range(lay.n)) - stored | {lay.n - 1})


Passes = Generator[Pass, BlendResult, None]


@dataclass(frozen=True)
class ReusePolicy:
    """Base of every policy, not one itself (it has no `name`): every cached chunk reused,
    none of its tokens recomputed, one pass, no choice of rows. A policy overrides only the
    answers it changes."""

    layer_budget_s: float = 0.05  # longest wait for one layer of the reused chunks

    name: ClassVar[str]  # what `Policy` and configuration call it

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_option(f.name, str(f.type), getattr(self, f.name))
        if not self.layer_budget_s >= 0:
            raise ValueError(f"layer_budget_s must be >= 0, got {self.layer_budget_s}")

    def reused(self, layout: Layout) -> list[int]:
        """Indices of the segments whose stored KV this policy reuses."""
        return [s for s, seg in enumerate(layout.segments) if seg.cached]

    def first_rows(self, layout: Layout, s: int) -> Sequence[int]:
        """Token indices inside reused chunk `s` computed from layer 0 on."""
        return ()

    def selection(self, prompt: Prompt) -> Selection:
        """The choice of rows per layer of this policy's pass."""
        return Selection()

    def passes(self, prompt: Prompt) -> Passes:
        """One pass: the computed rows and each reused chunk's `first_rows` from layer 0."""
        lay = prompt.layout
        first = set(prompt.computed())
        for s in prompt.reused:
            first |= {lay.edges[s] + i for i in self.first_rows(lay, s)}
        yield Pass(prompt.reused, sorted(first), self.selection(prompt), stats=prompt.stats)


def _check_option(name: str, kind: str, value: object) -> None:
    """An option of the type its field names (`int`, `float`, `str`, each maybe `| None`);
    ValueError naming it otherwise. Options reach a policy from requests (vLLM's
    kv_transfer_params, JSON): a bool is no number, a float no count, and no wait or share
    is infinite or NaN."""
    if value is None and kind.endswith("| None"):
        return
    kind = kind.removesuffix(" | None")
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "int" and not (number and isinstance(value, int)):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    if kind == "float" and not (number and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if kind == "str" and not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r}")


__all__ = ["Passes", "Prompt", "ReusePolicy"]
