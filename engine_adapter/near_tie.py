"""Near ties computed in full: a blended request whose first token leads the runner-up by less
than a margin is served by full prefill instead (docs/fidelity.md, "Near ties").

On MuSiQue at 10 passages the first tokens reuse loses are near ties. On records 72-119 full
prefill's own top next token leads the runner-up by a fraction of a logit where a reuse case lost
it (median 0.21 logits, against 1.95 where none did), and no choice of recomputed rows up to 15%
keeps 0.95 of first tokens. The blend's own lead is known with its first token, without full
prefill: a request whose lead is under the margin is computed again by full prefill before its
first token is returned. It pays the blend and full prefill; the others pay nothing. The margin
is the one each Plan gives, which the service learns per model from the leads of the sampled
blends that lost the first token (`kvservice.fidelity`), or the adapter's own
(`RAGAdapter(near_tie=...)`; docs/fidelity.md, "Near ties").
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch
from torch import Tensor

from engine_adapter.llama import LlamaEngine
from engine_adapter.prompt import Segment
from engine_adapter.result import BlendResult


def lead(logits: Tensor) -> float:
    """The top next-token logit over the runner-up's."""
    top = logits.float().reshape(-1).topk(2).values
    return float(top[0] - top[1])


@torch.no_grad()
def settle(engine: LlamaEngine, segments: Sequence[Segment], result: BlendResult, margin: float | None) -> BlendResult:
    """`result`, or, where it reused stored KV and its lead is under `margin`, full prefill of
    the same prompt (exact; `reuse` False, nothing reused), counted as the blend's rows and time
    plus full prefill's, every row through every layer. The blend's fresh chunks are kept, to
    store back."""
    if margin is None or not (result.reuse and result.reused_segments) or lead(result.logits) >= margin:
        return result
    tokens = [t for s in segments for t in s.tokens]
    t0 = time.perf_counter()
    logits, kv = engine.prefill(torch.tensor(tokens), all_logits=False)
    per_layer = (time.perf_counter() - t0) / engine.cfg.num_layers  # its layers alike, for the rates learned
    timings = [dataclasses.replace(t, compute_s=t.compute_s + per_layer) for t in result.timings]
    return dataclasses.replace(result, logits=logits[-1], kv=kv, reuse=False, reused_segments=[], timings=timings,
                               computed_rows=[r + len(tokens) for r in result.computed_rows], rows=None,
                               row_logits=None)


__all__ = ["lead", "settle"]
