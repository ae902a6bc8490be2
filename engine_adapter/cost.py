"""The cost gate: an adaptive request is blended only where blending beats exact reuse.

A blend computes its rows through kvcraft's layer step (the default policy's question pass,
the selection, attention over the merged cache), which costs more per row than the engine's
own prefill. Where few of a request's chunks are stored (a record's first retrieval, its
passages new), the blend computes most of the prompt and is no faster than full prefill, or
slower (docs/fidelity.md, "Blend only where it pays": `kvcraft bench blend-cost` and the
MuSiQue streams).

So an adaptive request is blended only where the rows its blend computes at its Plan's budget
(every row outside its stored chunks, and the budget's share of theirs) are under `BLEND_LIMIT`
of the rows exact reuse computes (every row past the leading chunks stored behind exactly the
chunks before them); any other is served by exact reuse (`PrefixOf`, budget 1: that prefix
from storage, the rest computed): its first token full prefill's, its fresh chunks stored back
as a blend's are, never slower than a prefix cache, and not a sample of the blend its Plan
offered. A request the Plan asks to measure is blended all the same (the controller judges its
budget by those samples, and exact reuse's own stored KV is measured through them). Through vLLM
such a request is left to vLLM alone, with vLLM's own prefix cache, measured or not (vLLM alone
reads no stored KV). Only the adaptive policy is gated: a policy named by the user runs as named.
"""

from __future__ import annotations

from typing import Sequence

from engine_adapter.policies.exact import Prefix
from engine_adapter.prompt import Layout

# Blend where it computes under 70% of exact reuse's rows: about where the blend and exact reuse
# took the same time at 5% and at 25% (`kvcraft bench blend-cost`, docs/fidelity.md).
BLEND_LIMIT = 0.7


def planned_share(prompt_tokens: int, stored: Sequence[int], exact_tokens: int, budget: float) -> float:
    """The rows a blend at `budget` computes over the rows exact reuse computes: every row
    outside the stored chunks (`stored`: each one's token count, the exact prefix's included)
    and `budget` of theirs, against every row past the leading `exact_tokens`. (What a blend
    adds to its budget, the question pass, is left out: it is small beside the rest.)"""
    blend_rows = prompt_tokens - (1.0 - budget) * sum(stored)
    return blend_rows / max(1, prompt_tokens - exact_tokens)


def worth_blending(lay: Layout, budget: float) -> bool:
    """Is a blend of the prompt `lay` at `budget` by the default policy (it reuses every stored
    chunk: `lay`'s cached segments) worth serving over exact reuse? Budgets outside (0, 1) are
    not a blend's: nothing to decide."""
    if not 0 < budget < 1:
        return True
    stored = [len(seg.tokens) for seg in lay.segments if seg.cached]
    exact = sum(len(lay.segments[s].tokens) for s in Prefix().reused(lay))
    return planned_share(lay.n, stored, exact, budget) < BLEND_LIMIT
