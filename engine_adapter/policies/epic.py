"""`epic`: EPIC's LegoLink (Hu et al. 2024, "EPIC: Efficient Position-Independent Context
Caching for Serving Large Language Models", §4): each reused chunk's first `tokens` tokens
are recomputed from layer 0, the rest served as stored.

A chunk computed alone (or behind another prefix) grows an attention sink at its own first
tokens: every later token of it puts much of its attention there, as a model does at the
start of a sequence. Reused in the middle of a prompt, those sinks draw the question's
attention away from where the answer is. Recomputing a chunk's first k tokens in place (they
now read the chunks before them) removes the sinks at O(k) rows a chunk; the chunk at the
prompt's start keeps its own, which is where full prefill has it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine_adapter.policies.base import ReusePolicy
from engine_adapter.prompt import Layout


@dataclass(frozen=True)
class Epic(ReusePolicy):
    tokens: int = 16  # k: each reused chunk's first tokens recomputed (LegoLink-16 in the paper's figures)

    name = "epic"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {self.tokens}")

    def first_rows(self, layout: Layout, s: int) -> Sequence[int]:
        if layout.edges[s] == 0:  # the prompt's first chunk: its sink is full prefill's own
            return ()
        return range(min(self.tokens, len(layout.segments[s].tokens)))


__all__ = ["Epic"]
