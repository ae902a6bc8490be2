"""Reuse probe: before a model (by ModelSpec fingerprint) first reuses stored KV, check that
the blend path reproduces the engine's own full prefill.

The probe runs the per-layer loop (`loop.run_pass`) directly; `blend.blend_prefill`
asks the gate here before it runs the policy's passes (blend -> probe -> loop, no cycle).

The probe stores a chunk computed alone (positions 0..T-1), moves it behind another
chunk, and runs a blend that recomputes 100% of its tokens (so the answer must equal
full prefill) through the whole reuse path: LayerSource, RoPE from the ModelSpec,
merged cache, selective attention. If the logits disagree beyond the dtype's
tolerance (e.g. the engine's RoPE base differs from the one its spec declares),
reuse stays off for that fingerprint: every later request is served by full prefill.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from engine_adapter.llama import LlamaEngine
from engine_adapter.loop import run_pass
from engine_adapter.prompt import Layout, Segment
from engine_adapter.selection import Pass
from engine_adapter.source import InMemoryLayerSource

log = logging.getLogger(__name__)

# max |logit diff| allowed, relative to max(1, max |logit|); bf16/fp16 measured in docs/adapter.md
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 6e-2, torch.float16: 1e-2}


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    max_diff: float
    tolerance: float


class _Trusted:
    """A gate that allows every model: for callers that checked the engine themselves
    (tests, benchmarks; the probe's own blends run the driver, which asks no gate)."""

    def allows(self, engine: LlamaEngine) -> bool:
        return True


TRUSTED = _Trusted()


@torch.no_grad()
def probe(engine: LlamaEngine, *, chunk_len: int = 16, question_len: int = 4, seed: int = 0) -> ProbeResult:
    g = torch.Generator().manual_seed(seed)
    # drawn on the CPU (the generator's device) whatever device the engine runs on
    a, b, q = (torch.randint(0, engine.cfg.vocab_size, (n,), generator=g, device="cpu").tolist()
               for n in (chunk_len, chunk_len, question_len))
    fp = engine.model_spec().fingerprint()
    alone = run_pass(engine, Layout.of([Segment(b)], fp), Pass((), range(len(b))), InMemoryLayerSource({}), 0.0)
    moved = Layout.of([Segment(a), Segment(b, cached=True), Segment(q, question=True)], fp)
    every = range(len(a) + len(b) + len(q))  # the stored chunk's every token recomputed
    out = run_pass(engine, moved, Pass((1,), every), InMemoryLayerSource({1: alone.fresh[0].kv}), 0.05)
    ref = engine.prefill(torch.tensor(a + b + q), all_logits=False, kv=False)[0][-1].float()
    tol = TOLERANCE.get(engine.dtype, 6e-2) * max(1.0, float(ref.abs().max()))
    diff = float((out.logits.float() - ref).abs().max())
    return ProbeResult(ok=diff <= tol, max_diff=diff, tolerance=tol)


class ReuseGate:
    """Per-fingerprint verdict of the probe, decided on the first reuse of a model."""

    def __init__(self) -> None:
        self._verdicts: dict[str, bool] = {}
        self._lock = threading.Lock()

    def allows(self, engine: LlamaEngine) -> bool:
        spec = engine.model_spec()
        fp = spec.fingerprint()
        with self._lock:
            if fp not in self._verdicts:
                r = probe(engine)
                if not r.ok:
                    log.error("reuse probe FAILED for model %s (fingerprint %s): blend vs full prefill "
                              "max |logit diff| %.3g > tolerance %.3g; KV reuse is OFF for this model, "
                              "serving by full prefill", spec.name, fp, r.max_diff, r.tolerance)
                self._verdicts[fp] = r.ok
            return self._verdicts[fp]

    def verdict(self, fingerprint: str) -> bool | None:
        return self._verdicts.get(fingerprint)


DEFAULT_GATE = ReuseGate()
