"""Blended prefill: reuse stored chunk KV, recompute only the rows that need it, layer by layer.

`blend_prefill` is the entry point: it lays the prompt out, lets the policy say which
chunks are reused, asks the reuse gate (the per-model probe, `probe.py`) before the
first reuse of a model, and runs the per-layer loop (`driver.py`, which the module
docstring there walks through). Dependencies point one way: blend -> probe -> driver.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from engine_adapter.driver import BlendResult, FreshChunk, LayerTiming, run_blend
from engine_adapter.llama import LlamaEngine
from engine_adapter.policy import ReusePolicy
from engine_adapter.probe import DEFAULT_GATE
from engine_adapter.prompt import Layout, Segment
from engine_adapter.query import query_aware_prefill
from engine_adapter.source import LayerSource

__all__ = ["BlendResult", "FreshChunk", "Gate", "LayerTiming", "blend_prefill"]


class Gate(Protocol):
    def allows(self, engine: LlamaEngine) -> bool:
        """May this engine's model reuse stored KV? (The reuse probe's verdict.)"""
        ...


@torch.no_grad()
def blend_prefill(engine: LlamaEngine, segments: Sequence[Segment], policy: ReusePolicy,
                  source: LayerSource, *, gate: Gate | None = None,
                  all_logits: bool = False, stats: bool = True) -> BlendResult:
    """Prefill `segments` reusing stored chunk KV from `source` as `policy` says.

    gate: None asks `probe.DEFAULT_GATE` (one probe per model fingerprint).
    stats: return the fresh chunks as new variants (KV + attention statistics, `.fresh`);
    False when nothing will be stored: their attention mass is then never computed."""
    spec = engine.model_spec()
    lay = Layout.of(segments, spec.fingerprint())
    reused = policy.reused(lay)
    if reused and not (gate or DEFAULT_GATE).allows(engine):
        return _serve_full(engine, lay)
    if reused and policy.asks_question_first:
        return query_aware_prefill(engine, lay, policy, source, reused, all_logits, stats)
    return run_blend(engine, lay, policy, source, reused, all_logits, stats)


def _serve_full(engine: LlamaEngine, lay: Layout) -> BlendResult:
    logits, kv = engine.prefill(lay.tokens, all_logits=False)
    return BlendResult(logits=logits[-1], kv=kv, reuse=False, prompt_tokens=lay.n,
                       computed_rows=[lay.n] * engine.cfg.num_layers)
