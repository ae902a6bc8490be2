"""A prompt as ordered segments: chunks (reused or fresh) and the question at the end."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import Tensor

from kvcraft.keys import chunk_key
from kvcraft.plans import Plan, variant_prefixes


@dataclass(frozen=True)
class Segment:
    """One span of the prompt.

    tokens        token ids of the span.
    key           chunk key (`kvcraft.keys.chunk_key`); computed from the tokens when empty.
    cached        a stored variant of this chunk arrives through the LayerSource.
    cached_prefix chunk keys the stored variant was computed behind, in order (the
                  `prefix` policy reuses a chunk only when this equals the chunks before it).
    recompute     token indices inside the chunk to recompute (the plan's Cache-Craft
                  top-N list, eq. 14); used by the `cachecraft` policy.
    question      the user question / suffix: never cached, always computed, last.
    """

    tokens: tuple[int, ...]
    key: str = ""
    cached: bool = False
    cached_prefix: tuple[str, ...] = ()
    recompute: tuple[int, ...] = ()
    question: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "cached_prefix", tuple(self.cached_prefix))
        object.__setattr__(self, "recompute", tuple(sorted({int(i) for i in self.recompute})))
        if not self.tokens:
            raise ValueError("a segment needs at least one token")
        if self.question and self.cached:
            raise ValueError("the question is never cached")
        if self.recompute and not 0 <= self.recompute[0] <= self.recompute[-1] < len(self.tokens):
            raise ValueError(f"recompute indices {self.recompute} outside a chunk of {len(self.tokens)} tokens")


@dataclass(frozen=True)
class Layout:
    """Where every segment sits in the prompt. Positions are 0..N-1 in segment order."""

    segments: tuple[Segment, ...]
    keys: tuple[str, ...]  # chunk key per segment ("" for the question)
    tokens: Tensor  # [N] long
    bounds: Tensor  # [S+1] long: segment s spans rows bounds[s]:bounds[s+1]
    # The same bounds as ints: spans and row ranges never read the tensor, which may live
    # in GPU memory (every read of it there would wait for the GPU).
    edges: tuple[int, ...]

    @classmethod
    def of(cls, segments: Sequence[Segment], model_id: str) -> "Layout":
        segments = tuple(segments)
        if not segments:
            raise ValueError("empty prompt")
        if any(s.question for s in segments[:-1]):
            raise ValueError("the question must be the last segment")
        keys = tuple("" if s.question else (s.key or chunk_key(model_id, s.tokens)) for s in segments)
        edges = tuple(itertools.accumulate((len(s.tokens) for s in segments), initial=0))
        tokens = torch.tensor([t for s in segments for t in s.tokens], dtype=torch.long)
        return cls(segments, keys, tokens, torch.tensor(edges, dtype=torch.long), edges)

    @property
    def n(self) -> int:
        return len(self.tokens)

    def question_rows(self) -> range:
        """The question's rows (the last row where the prompt has no question segment)."""
        return range(*self.edges[-2:]) if self.segments[-1].question else range(self.n - 1, self.n)

    def rows(self, s: int) -> Tensor:
        return torch.arange(self.edges[s], self.edges[s + 1])

    def span(self, s: int) -> slice:
        return slice(self.edges[s], self.edges[s + 1])

    def chunk_indices(self) -> list[int]:
        return [s for s, seg in enumerate(self.segments) if not seg.question]


def planned_chunks(plan: Plan, tokens: Mapping[str, Sequence[int]]) -> list[Segment]:
    """The chunks of a Plan as segments, in its order (`tokens`: each chunk's tokens by key):
    cached where the Plan reuses a stored variant, behind the chunks that variant was computed
    behind, with the Plan's recompute list. The question is the caller's to append."""
    return [Segment(tokens[cp.chunk_key], key=cp.chunk_key, cached=cp.reused, cached_prefix=prefix,
                    recompute=cp.recompute)
            for cp, prefix in zip(plan.chunks, variant_prefixes(plan))]
