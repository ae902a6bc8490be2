"""Blended prefill: reuse stored chunk KV, recompute only the rows that need it, layer by layer.

`blend_prefill` is the entry point: it lays the prompt out, lets the policy say which chunks
are reused, asks the reuse gate (the per-model probe, `probe.py`) before the first reuse of a
model, and runs the policy's passes (`run_passes`: each pass is the per-layer loop, `loop.py`,
which the module docstring there walks through). Dependencies point one way:
blend -> probe -> loop.
"""

from __future__ import annotations

import dataclasses
from itertools import zip_longest
from typing import Any, Protocol, Sequence

import torch

from engine_adapter.llama import LlamaEngine
from engine_adapter.loop import run_pass
from engine_adapter.policies.base import Prompt, ReusePolicy
from engine_adapter.policies.default import prefill_pass, question_pass
from engine_adapter.policies.picks import Picks, QuestionReads
from engine_adapter.probe import DEFAULT_GATE
from engine_adapter.prompt import Layout, Segment
from engine_adapter.result import BlendResult, FreshChunk, LayerTiming
from engine_adapter.source import LayerSource, ReplayLayerSource

__all__ = ["BlendResult", "FreshChunk", "Gate", "LayerTiming", "blend_prefill", "prefill_with_picks", "question_reads",
           "run_passes"]


class Gate(Protocol):
    def allows(self, engine: LlamaEngine) -> bool:
        """May this engine's model reuse stored KV? (The reuse probe's verdict.)"""
        ...


@torch.no_grad()
def blend_prefill(engine: LlamaEngine, segments: Sequence[Segment], policy: ReusePolicy,
                  source: LayerSource, *, gate: Gate | None = None, all_logits: bool = False,
                  stats: bool = True, steps: Any = None) -> BlendResult:
    """Prefill `segments` reusing stored chunk KV from `source` as `policy` says.

    gate: None asks `probe.DEFAULT_GATE` (one probe per model fingerprint).
    stats: return the fresh chunks as new variants (KV + attention statistics, `.fresh`);
    False when nothing will be stored: their attention mass is then never computed.
    steps: the engine's static steps (`graphs.StepGraphs`), where its layers run captured."""
    lay = Layout.of(segments, engine.model_spec().fingerprint())
    reused = policy.reused(lay)
    if reused and not (gate or DEFAULT_GATE).allows(engine):
        logits, kv = engine.prefill(lay.tokens, all_logits=False)
        return BlendResult(logits=logits[-1], kv=kv, reuse=False, prompt_tokens=lay.n,
                           computed_rows=[lay.n] * engine.cfg.num_layers)
    return run_passes(engine, lay, policy, source, reused, all_logits=all_logits, stats=stats, steps=steps)


@torch.no_grad()
def run_passes(engine: LlamaEngine, lay: Layout, policy: ReusePolicy, source: LayerSource, reused: Sequence[int],
               *, all_logits: bool = False, stats: bool = True, steps: Any = None) -> BlendResult:
    """The policy's passes (trusted: no gate asked), each over the stored layers the first read
    (`ReplayLayerSource`), as one prefill: the last pass's result, with every pass's rows,
    timings and fallbacks counted (`computed_share` is what the prefill computed in all)."""
    replay = ReplayLayerSource(source)
    passes = policy.passes(Prompt(lay, tuple(reused), engine.cfg.num_layers, stats))
    done: list[BlendResult] = []
    spec = next(passes)
    while True:
        done.append(run_pass(engine, lay, spec, replay, policy.layer_budget_s, steps=steps, all_logits=all_logits))
        try:
            spec = passes.send(done[-1])
        except StopIteration:
            break
    res = done[-1]
    if len(done) > 1:
        res.computed_rows = [sum(x) for x in zip_longest(*(r.computed_rows for r in done), fillvalue=0)]
        res.timings = [LayerTiming(wait_s=sum(t.wait_s for t in ts), compute_s=sum(t.compute_s for t in ts),
                                   rotate_s=sum(t.rotate_s for t in ts), attend_s=sum(t.attend_s for t in ts),
                                   static=any(t.static for t in ts))
                       for ts in zip_longest(*(r.timings for r in done), fillvalue=LayerTiming(0.0, 0.0))]
        res.fallbacks = [f for r in done for f in r.fallbacks]
    return res


@torch.no_grad()
def question_reads(engine: LlamaEngine, lay: Layout, source: LayerSource, reused: Sequence[int], *,
                   deviation: bool = False, layer_budget_s: float = 0.05, steps: Any = None) -> QuestionReads:
    """The default policy's question pass alone (`policies.default.question_pass`): what the
    question reads of each row, and with `deviation` each reused row's stored layer-1 K/V's
    deviation (benchmarks that rank rows by other scores start from it)."""
    phase, spec = question_pass(Prompt(lay, tuple(reused), engine.cfg.num_layers, False), deviation)
    return phase.outcome(run_pass(engine, lay, spec, source, layer_budget_s, steps=steps))


@torch.no_grad()
def prefill_with_picks(engine: LlamaEngine, lay: Layout, q: QuestionReads, picks: Picks, source: LayerSource, *,
                       stats: bool = True, layer_budget_s: float = 0.05) -> BlendResult:
    """The default policy's second pass alone (`policies.default.prefill_pass`), after the
    question pass `q`, with `picks` (any rows: an oracle's, another score's). It writes its rows
    over copies of `q`'s merged caches, so one question pass serves any number of them."""
    prompt = Prompt(lay, tuple(q.result.reused_segments), engine.cfg.num_layers, stats)
    kept = dataclasses.replace(q.result, kv=[(k.clone(), v.clone()) for k, v in q.result.kv])
    return run_pass(engine, lay, prefill_pass(prompt, dataclasses.replace(q, result=kept), picks), source,
                    layer_budget_s)
