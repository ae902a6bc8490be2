"""Sampled shadow prefills: how far a served request's answer is from full prefill's, on live traffic.

For the requests served from stored KV (blended: at least one chunk reused) whose Plan
asks for it (`Plan.fidelity_sample`: the service chooses, `kvservice.fidelity`),
`ShadowSampler` computes full prefill of the same prompt tokens in the order served, on a
background thread after the request's first-token logits exist (the request never waits
for it), and compares the two next-token distributions at the last prompt position
(`compare`): top-1 agreement and KL(full || served). For a request that generated
(`RAGAdapter.generate`) the shadow runs after its answer and also feeds full prefill the
answer's first ANSWER_TOKENS tokens after the first (teacher forcing: a few rows more than
the prompt's): `answer_agreement` counts the positions where full prefill predicts the
token the served request chose next, the drift the first token alone does not show.

A Plan may also name a budget below the one served (`Plan.fidelity_below`: the service
measures it before serving it, `kvservice.fidelity`). The request's stored KV is
then copied as it arrives (`source.RecordingLayerSource`), and the shadow blends the request
again at that budget from the same KV and compares that blend with full prefill too (a
*shadow blend*; first token only). Each comparison is a `pb.FidelitySample` that the adapter
sends with its next Plan (at most `MAX_SAMPLES_PER_PLAN`); the service tallies them per
model, policy and budget (`kvservice.fidelity`, `kvcraft admin fidelity`).

The shadows' compute is counted beside the served requests' (`SamplingCost`): the
sampling's overhead. A shadow gives way to the requests its engine is serving (`Serving`):
each of its model calls waits, at most YIELD_S, until no prefill of the engine's adapters is
running, so on a machine whose cores the served requests fill it takes what they leave
instead of half of them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor

from engine_adapter.blend import blend_prefill
from engine_adapter.result import BlendResult
from engine_adapter.llama import LlamaEngine
from engine_adapter.model import LayerModel
from engine_adapter.near_tie import lead
from engine_adapter.policy import ReusePolicy
from engine_adapter.probe import TRUSTED
from engine_adapter.prompt import Segment
from engine_adapter.source import RecordedLayerSource
from engine_adapter.threads import one_omp_thread
from kvcraft.heap import IdleTrim
from kvcraft.v1 import kvcraft_pb2 as pb

log = logging.getLogger(__name__)

MAX_SAMPLES_PER_PLAN = 64  # the service's bound (kvservice.server.checks)
MAX_PENDING = 1024  # samples kept while no Plan takes them (service down): the oldest go first
MAX_QUEUED = 8  # shadows waiting for the worker; a request sampled beyond that is skipped
# Shadows holding a copy of their request's stored KV for a shadow blend (a prompt's KV in
# the engine's dtype: ~90 MB for SmolLM2-135M at 2,000 tokens in float32); beyond that a
# sampled request gets its full prefill alone.
MAX_SHADOW_BLENDS = 2
ANSWER_TOKENS = 16  # answer tokens after the first a shadow compares under teacher forcing
# Longest a shadow's model call waits for the engine's served prefills to end: under a steady
# stream of requests a shadow still finishes, a layer call at a time. On a CPU each call it makes
# beside a blend slows that blend (one core of the blend's two, docs/vllm.md "One OpenMP team"):
# at 0.25 s, 32 requests at once through vLLM ran at 2.4-2.5 requests/s, at 1 s 3.1-3.6 (2-core VM).
YIELD_S = 1.0


class Serving:
    """The prefills an engine is serving now (one for all the adapters over one engine), for
    its shadows to give way to. With `trim_idle_s`, the heap is trimmed once neither served
    work nor a shadow has run for that long (`kvcraft.heap.IdleTrim`: inside an inference
    engine's process, where kvcraft's threads' freed memory would stay resident)."""

    def __init__(self, trim_idle_s: float | None = None, on_trim: Callable[[], None] = lambda: None) -> None:
        self._running = 0
        self._held: dict[str, float] = {}  # key -> when its hold ends by itself (`hold`)
        self._idle = threading.Condition()
        self.trim = IdleTrim(self.busy, trim_idle_s, on_trim) if trim_idle_s is not None else None

    @contextlib.contextmanager
    def prefill(self) -> Iterator[None]:
        """Around a served prefill."""
        self.begin()
        try:
            yield
        finally:
            self.end()

    def begin(self) -> None:
        """A served request's work starts (`end` when it ends: the engine's forward pass after a
        blend, for one)."""
        with self._idle:
            self._running += 1
        self.touch()

    def end(self) -> None:
        with self._idle:
            self._running -= 1
            self._idle.notify_all()
        self.touch()

    def hold(self, key: str, seconds: float) -> None:
        """Served work that ends when `release(key)` says so, or by itself after `seconds`
        (an engine's forward pass over a blended request, which may never come)."""
        with self._idle:
            self._held[key] = time.monotonic() + seconds

    def release(self, key: str) -> None:
        with self._idle:
            if self._held.pop(key, None) is not None:
                self._idle.notify_all()
        self.touch()

    def watch(self, pool: ThreadPoolExecutor) -> None:
        """`pool`'s threads do this engine's kvcraft work: the idle trim releases their heaps too."""
        if self.trim is not None:
            self.trim.watch(pool)

    def touch(self) -> None:
        """kvcraft work started or ended (served, or a shadow): the idle trim waits again."""
        if self.trim is not None:
            self.trim.touch()

    def busy(self) -> bool:
        """Whether a served prefill runs or a hold lasts."""
        with self._idle:
            return self._busy(time.monotonic())

    def _busy(self, now: float) -> bool:
        """`busy`, under the lock; the holds ended by `now` dropped."""
        self._held = {k: t for k, t in self._held.items() if t > now}
        return bool(self._running or self._held)

    def close(self) -> None:
        if self.trim is not None:
            self.trim.close()

    def wait_idle(self, timeout: float) -> bool:
        """Until no served prefill runs nor hold lasts, at most `timeout` seconds; whether so."""
        end = time.monotonic() + timeout
        with self._idle:
            while True:
                now = time.monotonic()
                if not self._busy(now):
                    return True
                if now >= end:
                    return False
                self._idle.wait(min([end] + list(self._held.values())) - now)


class _GivingWay(LayerModel):
    """`model` for a shadow: each call first waits (at most YIELD_S) for `serving` to be idle."""

    def __init__(self, model: LlamaEngine, serving: Serving) -> None:
        self.m, self.serving = model, serving
        self.cfg, self.rope, self.scale = model.cfg, model.rope, model.scale
        self.triton, self.dtype, self.device = model.triton, model.dtype, model.device
        self.max_rows, self.attention = model.max_rows, model.attention

    def embed(self, tokens: Tensor) -> Tensor:
        self.serving.wait_idle(YIELD_S)
        return self.m.embed(tokens)

    def qkv_heads(self, layer: int, h: Tensor) -> Tensor:
        self.serving.wait_idle(YIELD_S)
        return self.m.qkv_heads(layer, h)

    def layer_out(self, layer: int, h: Tensor, o: Tensor) -> Tensor:
        self.serving.wait_idle(YIELD_S)
        return self.m.layer_out(layer, h, o)

    def logits(self, h: Tensor) -> Tensor:
        self.serving.wait_idle(YIELD_S)
        return self.m.logits(h)

    def model_spec(self):  # noqa: ANN201 - the model's
        return self.m.model_spec()


@torch.no_grad()
def compare(full: Tensor, served: Tensor) -> tuple[bool, float]:
    """Top-1 agreement and KL(full || served), in nats, of two next-token logit vectors [V]:
    softmax in float64, so that the KL of near-equal distributions is not rounding noise."""
    log_p = torch.log_softmax(full.detach().to(torch.float64).cpu(), dim=-1)
    log_q = torch.log_softmax(served.detach().to(torch.float64).cpu(), dim=-1)
    kl = float((log_p.exp() * (log_p - log_q)).sum())
    return int(full.argmax()) == int(served.argmax()), max(kl, 0.0)


def answer_agreement(full: Tensor, answer: Sequence[int]) -> tuple[int, int]:
    """Teacher forcing: full: the logits [m, V] of full prefill over prompt + answer[:m-1],
    at the last prompt position and the m-1 positions after it; answer: the served tokens,
    answer[0] the first. Returns (tokens compared, agreeing): the positions i in 1..m-1 where
    full prefill's argmax is answer[i]."""
    picks = full[1:].argmax(dim=-1).tolist()
    return len(picks), sum(int(p == int(t)) for p, t in zip(picks, answer[1:]))


@dataclass(frozen=True)
class ShadowBlend:
    """A shadow blend to compute beside a shadow prefill: the request's segments as served,
    the policy at the budget below (`Plan.fidelity_below`), and the stored KV the request was
    served from, copied."""

    segments: Sequence[Segment]
    policy: ReusePolicy
    budget: float
    source: RecordedLayerSource


@dataclass(frozen=True)
class SamplingCost:
    """What the sampling cost beside the traffic it measured, since the adapter started."""

    served: int  # requests served
    blended: int  # of those, served from stored KV
    sampled: int  # of those, given a shadow prefill (finished or not)
    served_row_layers: int  # rows computed by the served prefills, summed over layers
    served_compute_s: float  # their compute time (layer loops; loads excluded)
    shadow_row_layers: int  # rows the finished shadows computed (their prefills' prompt x layers, and blends')
    shadow_s: float  # their time
    shadow_blends: int = 0  # of the finished shadows, those that also blended at the budget below

    @property
    def row_share(self) -> float:
        """The shadows' row-layers as a share of all row-layers computed (served + shadows)."""
        total = self.served_row_layers + self.shadow_row_layers
        return self.shadow_row_layers / total if total else 0.0


class ShadowSampler:
    """Chooses the requests to measure, runs their shadow prefills on one background
    thread, and keeps the samples until a Plan takes them. Thread-safe."""

    def __init__(self, engine: LlamaEngine, serving: Serving | None = None) -> None:
        """serving: the engine's served prefills, which the shadows give way to (None: the
        adapter's alone)."""
        self.engine = engine
        self.serving = serving or Serving()
        self.model = _GivingWay(engine, self.serving)  # what the shadows compute with (its `prefill`, their full prefill)
        self._lock = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None  # made at the first sample
        self._queued: list[Future] = []
        self._samples: list[pb.FidelitySample] = []
        self._served = self._blended = self._sampled = self._blends = 0
        self._blends_held = 0  # queued shadows holding a copy of stored KV
        self._served_rows = self._shadow_rows = 0
        self._served_s = self._shadow_s = 0.0

    def can_blend(self) -> bool:
        """Whether a request sampled now may copy its stored KV for a shadow blend."""
        with self._lock:
            return self._blends_held < MAX_SHADOW_BLENDS

    def observe(self, spans: Sequence[Sequence[int]], result: BlendResult, policy: str, budget: float,
                sample: bool, answer: Sequence[int] = (), below: ShadowBlend | None = None,
                blend: BlendResult | None = None) -> bool:
        """Count a served request; if it is blended and `sample` (its Plan asked), queue its
        shadow prefill. spans: the prompt's token spans in the order served (chunks, then the
        question); budget: the recompute budget it ran with (0: its policy has none); answer:
        the tokens it generated, if any (the first from `result.logits`), compared under
        teacher forcing; below: the shadow blend to compute as well, if the Plan named a
        budget below (its stored KV is let go if the request is not sampled); blend: the blend
        a near tie was served by full prefill (`result`) instead of: the sample is the blend's,
        against `result`'s logits, no shadow prefill (nor answer) to compute. Returns whether
        it was sampled."""
        full = result.logits if blend is not None and blend is not result else None
        with self._lock:
            self._served += 1
            self._served_rows += sum(result.computed_rows) if result.computed_rows else 0
            self._served_s += sum(t.compute_s for t in result.timings)
            if full is not None:
                result, answer = blend, ()
            if not (result.reuse and result.reused_segments):
                return False
            self._blended += full is None  # a near tie was served by full prefill, not from stored KV
            if not sample:
                return False
            self._queued = [f for f in self._queued if not f.done()]
            if len(self._queued) >= MAX_QUEUED:
                log.info("kvcraft fidelity: %d shadow prefills queued; this request is not sampled", MAX_QUEUED)
                return False
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcraft-fidelity",
                                                  initializer=one_omp_thread)
                self.serving.watch(self._worker)
            self._sampled += 1
            served = result.logits.detach().clone()
            share = result.computed_share
            answer = [int(t) for t in answer[:ANSWER_TOKENS + 1]]
            self._blends_held += below is not None
            full = full.detach().clone() if full is not None else None
            self._queued.append(self._worker.submit(self._shadow, list(spans), served, policy, budget, share, answer,
                                                    below, full))
            return True

    def _shadow(self, spans: list[Sequence[int]], served: Tensor, policy: str, budget: float, share: float,
                answer: list[int], below: ShadowBlend | None, full: Tensor | None) -> None:
        self.serving.touch()
        try:
            self._measure(spans, served, policy, budget, share, answer, below, full)
        finally:
            self.serving.touch()

    def _measure(self, spans: list[Sequence[int]], served: Tensor, policy: str, budget: float, share: float,
                 answer: list[int], below: ShadowBlend | None, full: Tensor | None) -> None:
        """full: full prefill's logits, computed already (a near tie's): no shadow prefill."""
        t0 = time.perf_counter()
        fed = max(len(answer) - 1, 0)  # the last answer token is predicted, never fed
        tokens = torch.tensor([t for span in spans for t in span] + answer[:fed], dtype=torch.long)  # [N + fed]
        try:
            logits = (full[None] if full is not None else
                      self.model.prefill(tokens, all_logits=False, last=fed + 1, kv=False)[0])  # [fed + 1, V]
            agree, kl = compare(logits[0], served)
            compared, answer_agree = answer_agreement(logits, answer)
        except Exception as e:  # noqa: BLE001 - a failed shadow never touches the traffic
            log.warning("kvcraft fidelity: a shadow prefill failed (%s); no sample", e)
            self._let_go(below)
            return
        samples = [pb.FidelitySample(policy=policy, top1_agree=agree, kl=kl, computed_share=share, budget=budget,
                                     answer_tokens=compared, answer_agree=answer_agree, lead=lead(served))]
        rows = len(tokens) * self.engine.cfg.num_layers if full is None else 0
        if below is not None:
            try:
                blended = blend_prefill(self.model, below.segments, below.policy, below.source, gate=TRUSTED,
                                        stats=False)
                agree, kl = compare(logits[0], blended.logits)
                samples.append(pb.FidelitySample(policy=policy, top1_agree=agree, kl=kl, budget=below.budget,
                                                 computed_share=blended.computed_share, shadow_blend=True,
                                                 lead=lead(blended.logits)))
                rows += sum(blended.computed_rows)
            except Exception as e:  # noqa: BLE001
                log.warning("kvcraft fidelity: a shadow blend failed (%s); its sample is skipped", e)
            finally:
                self._let_go(below)
        seconds = time.perf_counter() - t0
        with self._lock:
            self._shadow_rows += rows
            self._shadow_s += seconds
            self._blends += len(samples) - 1
            self._samples.extend(samples)
            del self._samples[:-MAX_PENDING]

    def _let_go(self, below: ShadowBlend | None) -> None:
        if below is not None:
            with self._lock:
                self._blends_held -= 1

    def take(self, limit: int = MAX_SAMPLES_PER_PLAN) -> list[pb.FidelitySample]:
        """The oldest finished samples, at most `limit` (and forget them)."""
        with self._lock:
            out, self._samples = self._samples[:max(limit, 0)], self._samples[max(limit, 0):]
        return out

    def wait(self) -> None:
        """Until every queued shadow has finished."""
        with self._lock:
            queued, self._queued = self._queued, []
        for f in queued:
            f.result()

    def cost(self) -> SamplingCost:
        with self._lock:
            return SamplingCost(self._served, self._blended, self._sampled, self._served_rows, self._served_s,
                                self._shadow_rows, self._shadow_s, self._blends)

    def close(self) -> None:
        self.wait()
        if self._worker is not None:
            self._worker.shutdown()
