"""The adapter's link to a kvcraft service: plan, load layer by layer, store back.

`RAGAdapter.prefill` serves one RAG request:
  Plan (reorder, dedup, variant choice, lease) -> `loader.ServiceLayerSource` (shared
  memory when `local`, else one FetchLayers stream at most the plan's preload depth Lp
  layers ahead of the layer being computed, Cache-Craft Alg. 2) -> blend_prefill
  -> Release -> store the freshly computed chunks back in the background -> keep the
  measured per-layer timings for the next Plan (the loading controller learns from them).
Whatever the service does (down, slow, a chunk dropped as corrupt) the request completes:
a missing layer is computed by the driver, a failed Plan means full prefill.

Learned recompute lists (`engine_adapter.learned`: which tokens of a reused chunk to
recompute, measured at a request's answer instead of estimated from attention; `learn=True`,
off by default): when a request computed a chunk in full although a variant of it is stored
(the plan named one, or the service lists one behind another prefix), the store-back fetches
that variant, measures per token what recomputing it repairs of this request's answer
(`learned.learn`: greedy from the token whose stale KV costs the answer most, `fresh_gain`,
adding the tokens whose recompute repairs most, `recompute_gain`), merges that with the
variant's own scores and sends the result as the new variant's `recompute_scores`. The
planner then spends its recompute budget on them. All of it runs on the background
store-back thread, after the request's first token.

Fidelity on live traffic (`engine_adapter.fidelity`, `kvservice.fidelity`): the requests
served from stored KV whose Plan says `fidelity_sample` are computed again by full prefill
on a background thread after their first token, and the comparisons travel to the service
with the next Plan, beside the timings. An adapter that runs the default policy is
*adaptive*: it spends the recompute budget its Plan gives (`Plan.recompute_budget`, the
service's fidelity controller; 1 means exact reuse only, the prefix cache's), so the service
holds its model's first-token agreement at `fidelity_target`, and serves exact reuse where the
blend would not be faster (`engine_adapter.cost`). An adapter given a policy spends its budget.
`RAGAdapter.generate` also decodes the answer; a sampled request's shadow compares it too.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from engine_adapter import learned
from engine_adapter.blend import BlendResult, Gate, blend_prefill
from engine_adapter.cost import worth_blending
from engine_adapter.fidelity import MAX_SAMPLES_PER_PLAN, SamplingCost, Serving, ShadowBlend, ShadowSampler
from engine_adapter.generate import Generation, greedy
from engine_adapter.graphs import StepGraphs
from engine_adapter.llama import LlamaEngine
from engine_adapter.loader import ServiceLayerSource
from engine_adapter.near_tie import settle
from engine_adapter.policy import DEFAULT_POLICY, ReusePolicy, parse_policy, spent_budget, with_budget
from engine_adapter.prompt import Layout, Segment, planned_chunks
from engine_adapter.source import RecordingLayerSource
from engine_adapter.threads import one_omp_thread
from kvclient.client import KVClient, Ref
from kvclient.copy_stream import GpuLayerSource
from kvclient.errors import InvalidArgumentError, KVCraftError
from kvcraft.keys import chunk_key
from kvcraft.plans import Plan
from kvcraft.recompute import merge_scores
from kvcraft.records import VariantStats
from kvcraft.v1 import kvcraft_pb2 as pb

log = logging.getLogger(__name__)

# A stream's own bound: the driver waits per layer (the policy's layer_budget_s) and
# computes what is late, so this only ends a stream nobody reads any more.
FETCH_TIMEOUT_S = 60.0


@dataclass
class RequestReport:
    """What one request did, for logs, the demo and benchmarks."""

    policy: str
    order: list[str]
    dropped: list[str]
    reused_chunks: int  # chunks whose stored KV the prefill used (0 with policy full)
    fresh_chunks: int  # chunks the plan had no variant for (computed, stored back)
    prompt_tokens: int
    computed_rows: int  # rows computed, summed over layers
    recomputed_rows: int  # of those, rows of reused chunks
    fetch_wait_s: float  # time blocked waiting for layers
    ttft_s: float  # plan + fetch + prefill, until the first token's logits
    fallbacks: list[tuple[int, int]] = field(default_factory=list)
    plan_error: str = ""
    sampled: bool = False  # a shadow full prefill measures this request's fidelity (after it)
    budget: float = 0.0  # the recompute budget it ran with (1: exact reuse only, or full prefill); 0: none
    near_tie: bool = False  # blended, then served by full prefill: its first token led by under `near_tie`
    blend_skipped: bool = False  # its Plan's budget, served by exact reuse: no blend paid (`engine_adapter.cost`)


class RAGAdapter:
    """An engine plus a kvcraft service: serves RAG prefills with stored chunk KV."""

    def __init__(self, engine: LlamaEngine, client: KVClient, policy: ReusePolicy | None = None, *,
                 gate: Gate | None = None, store_back: bool = True, local: bool = False,
                 learn: bool = False, shadows: bool = True, steps: StepGraphs | None = None,
                 serving: Serving | None = None, near_tie: float | None = None) -> None:
        """policy: None runs the default (`policy.DEFAULT_POLICY`) with the recompute budget
        each Plan gives (the service's fidelity controller); a policy given runs as given.
        local: the service runs on this host; read reused KV from its shared memory (Locate)
        instead of streaming it over gRPC. learn: store-back sends learned recompute scores for chunks computed
        in full while a variant of them is stored (for `cachecraft`'s lists; off by default:
        the default policy does not use them, and learning costs (T + 2) x (question +
        chosen + 1) rows of compute per chunk of T tokens and round, docs/adapter.md).
        shadows: run the shadow full prefills Plans ask for (`engine_adapter.fidelity`); off
        only where something else computes full prefill of every prompt (benchmarks).
        steps: the engine's static steps (`graphs.StepGraphs`, CUDA graphs; adapters of one
        engine may share them: a prefill that finds them in use runs eagerly).
        serving: the prefills the engine serves, shared by the adapters over one engine (its
        shadows give way to all of them; `fidelity.Serving`; None: this adapter's own).
        near_tie: a blended request whose first token leads by less than this many logits is
        served by full prefill instead (`engine_adapter.near_tie`; None: the margin each Plan
        gives, learned by the service from its samples; 0: never)."""
        self.steps, self.local, self.learn, self.near_tie = steps, local, learn, near_tie
        self.engine = engine
        self.client = client
        self.policy = policy if policy is not None else parse_policy(DEFAULT_POLICY)
        self.adaptive = policy is None  # spends the Plans' recompute_budget
        self.shadows = shadows
        self.gate = gate
        self.store_back = store_back
        self.model_id = engine.model_spec().fingerprint()
        self._stores = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcraft-store", initializer=one_omp_thread)
        self._pending: list[Future] = []
        self._timings = pb.TimingReport()
        self._plan_tiers: dict[int, str] = {}  # segment -> tier its variant was in when planned
        self.fidelity = ShadowSampler(engine, serving)

    def prefill(self, chunks: Sequence[Sequence[int]], question: Sequence[int],
                conversation_id: str = "", reorder: bool = True) -> tuple[BlendResult, RequestReport]:
        """reorder=False keeps the retriever's order (CRAFT reorder off for this request:
        use it when chunk order carries meaning)."""
        return self._request(chunks, question, conversation_id, reorder)

    def generate(self, chunks: Sequence[Sequence[int]], question: Sequence[int], max_new_tokens: int,
                 stop: Iterable[int] = (), conversation_id: str = "", reorder: bool = True
                 ) -> tuple[Generation, BlendResult, RequestReport]:
        """`prefill`, then greedy decoding of the answer (`generate.greedy`, up to max_new_tokens,
        a stop token included); a sampled request's shadow compares those too (teacher forcing)."""
        answers: list[Generation] = []

        def answer(result: BlendResult) -> Sequence[int]:
            answers.append(greedy(self.engine, result.logits, result.kv, max_new_tokens, stop))
            return answers[0].tokens

        result, report = self._request(chunks, question, conversation_id, reorder, answer)
        return answers[0], result, report

    def _request(self, chunks: Sequence[Sequence[int]], question: Sequence[int], conversation_id: str,
                 reorder: bool, answer: Callable[[BlendResult], Sequence[int]] | None = None
                 ) -> tuple[BlendResult, RequestReport]:
        t0 = time.perf_counter()
        self._add_samples()

        def plan_it() -> Plan:
            return self.client.plan(self.model_id, [list(c) for c in chunks], len(question),
                                    conversation_id=conversation_id, timings=self._timings,
                                    first_turn=None if reorder else False, policy=self.policy.name,
                                    adaptive=self.adaptive)

        try:
            try:
                plan = plan_it()
            except InvalidArgumentError as e:  # timings or samples it refuses: never again
                if self._timings == pb.TimingReport():
                    raise
                log.warning("kvcraft refused this adapter's timings (%s); dropped them", e)
                self._timings = pb.TimingReport()
                plan = plan_it()
            self._timings = pb.TimingReport()
        except KVCraftError as e:  # service down or slow: serve by full prefill, never fail
            log.warning("kvcraft Plan failed (%s); serving this request by full prefill", e)
            plan = None
        return self.serve(plan, chunks, question, t0=t0, answer=answer)

    def serve(self, plan: Plan | None, chunks: Sequence[Sequence[int]], question: Sequence[int], *,
              policy: ReusePolicy | None = None, t0: float | None = None,
              answer: Callable[[BlendResult], Sequence[int]] | None = None) -> tuple[BlendResult, RequestReport]:
        """What `prefill` does after its Plan: fetch (shared memory when `local`), blend, release the
        leases, store fresh chunks back. `plan`: a Plan of `chunks` (None: full prefill); `policy`:
        this request's (default: the adapter's, cost-gated); `answer`: decodes the answer after the
        prefill (for the shadow). The vLLM connector's worker side calls it with its scheduler's plan."""
        t0 = time.perf_counter() if t0 is None else t0
        by_key = {chunk_key(self.model_id, c): tuple(int(t) for t in c) for c in chunks}
        segments, refs = self._segments(plan, by_key, chunks, question)
        lay = Layout.of(segments, self.model_id)  # adaptive, unmeasured: blended where that beats exact reuse
        sample = bool(plan and plan.fidelity_sample and self.shadows)
        skipped = bool(plan and policy is None and self.adaptive and not sample)
        skipped = skipped and not worth_blending(lay, plan.recompute_budget)
        policy = policy or self._budgeted(plan, exact=skipped)
        reused = set(policy.reused(lay))
        refs = {s: r for s, r in refs.items() if s in reused}  # what it reads (full prefill: none) is all streamed
        source = ServiceLayerSource(self.client, refs, local=self.local,
                                    deadline=time.monotonic() + FETCH_TIMEOUT_S,
                                    depth=max(1, plan.preload_depth) if plan else 1)
        # An engine on a GPU takes the layers in its memory: host-tier and streamed layers are
        # copied on a side stream while it computes the layer before (a gpu tier's are there).
        feed = (GpuLayerSource(source, self.engine.cfg.num_layers, self.engine.device)
                if refs and self.engine.device.type == "cuda" else source)
        budget = spent_budget(policy)
        recording = None  # the stored KV copied as it arrives, for the shadow's blend at the budget below
        if sample and refs and 0 < plan.fidelity_below < budget and self.fidelity.can_blend():
            recording = RecordingLayerSource(feed)
        try:
            with self.fidelity.serving.prefill():  # the shadows give way meanwhile
                blend = blend_prefill(self.engine, segments, policy, recording or feed, gate=self.gate,
                                      stats=self.store_back, steps=self.steps)
                margin = self.near_tie if self.near_tie is not None else plan.near_tie if plan else None
                result = settle(self.engine, segments, blend, margin if budget < 1 else None)  # exact: as is
        finally:
            if feed is not source:
                source.cancel()  # a copy feeder waiting on the stream returns
                feed.close()  # every copy done before the lease goes: mapped layers alias the service's memory
            source.close()
            if plan is not None and plan.lease_id:
                self._release(plan.lease_id)
        ttft = time.perf_counter() - t0
        if source.error and result.fallbacks:
            log.warning("kvcraft fetch stopped (%s); the layers not received were computed instead", source.error)
        if source.elsewhere:
            self.local = False
            log.warning("kvcraft: the service's shared memory is not on this host (%s); this adapter streams "
                        "from now on", source.local_error)
        if self.store_back and result.fresh:
            self._store_back(segments, result, refs)
        self._learn(source, result)
        tokens = answer(result) if answer is not None else ()
        below = (ShadowBlend(segments, with_budget(policy, plan.fidelity_below), plan.fidelity_below,
                             recording.replay()) if recording else None)
        sampled = self.fidelity.observe([s.tokens for s in segments], result, policy.name, budget, sample, tokens,
                                        below, blend)
        report = RequestReport(
            policy=policy.name,
            order=list(plan.order) if plan else [chunk_key(self.model_id, c) for c in chunks],
            dropped=list(plan.dropped) if plan else [],
            reused_chunks=len(result.reused_segments),  # what served, not what the plan offered
            fresh_chunks=sum(1 for s in segments if not s.cached and not s.question),
            prompt_tokens=sum(len(s.tokens) for s in segments),
            computed_rows=sum(result.computed_rows),
            recomputed_rows=sum(result.recomputed_rows),
            fetch_wait_s=sum(t.wait_s for t in result.timings),
            ttft_s=ttft,
            fallbacks=list(result.fallbacks), plan_error="" if plan else "plan failed", sampled=sampled,
            budget=plan.recompute_budget if skipped else budget,
            near_tie=result is not blend, blend_skipped=skipped,
        )
        return result, report

    def _budgeted(self, plan: Plan | None, exact: bool = False) -> ReusePolicy:
        """The policy this request runs: an adaptive adapter's default policy with its Plan's
        recompute budget (`exact`: 1, exact reuse only), else the adapter's own."""
        if plan is None or not self.adaptive:
            return self.policy
        return with_budget(self.policy, 1.0 if exact else plan.recompute_budget, reuse=not plan.no_reuse)

    def _segments(self, plan: Plan | None, by_key: dict[str, tuple[int, ...]],
                  chunks: Sequence[Sequence[int]], question: Sequence[int]) -> tuple[list[Segment], dict[int, Ref]]:
        if plan is None:
            segments, reused = [Segment(tuple(c)) for c in chunks], {}
        else:
            segments, reused = planned_chunks(plan, by_key), {s: cp for s, cp in enumerate(plan.chunks) if cp.reused}
        self._plan_tiers = {s: cp.tier for s, cp in reused.items()}
        segments.append(Segment(tuple(question), question=True))
        return segments, {s: Ref(cp.chunk_key, cp.variant_id, cp.cfo) for s, cp in reused.items()}

    def _release(self, lease_id: str) -> None:
        try:
            self.client.release(lease_id)
        except KVCraftError as e:  # the lease times out by itself
            log.warning("kvcraft Release failed (%s); the lease will time out", e)

    def _store_back(self, segments: list[Segment], result: BlendResult, refs: Mapping[int, Ref]) -> None:
        """Store the fresh chunks in the background; refs: segment -> the variant the plan named.
        On a tensor-parallel engine each is gathered whole first (every rank takes part) and
        rank 0 stores it (`ranks.TensorRanks`)."""
        self._pending = [f for f in self._pending if not f.done()]  # a long-lived adapter keeps only live ones
        question = segments[-1].tokens if segments[-1].question else ()
        q0 = sum(len(seg.tokens) for seg in segments[:-1])
        # The request's cache before its question (K rotated), for the learned scores.
        context = [(k[:, :q0], v[:, :q0]) for k, v in result.kv] if self.learn and question else None
        starts = [0]
        for seg in segments:
            starts.append(starts[-1] + len(seg.tokens))
        ranks = self.engine.ranks
        whole = self.engine.model_spec().num_kv_heads  # stored KV holds every KV head of the model
        for s, fresh in result.fresh.items():
            tokens = segments[s].tokens
            kv = [(k.contiguous(), v.contiguous()) for k, v in fresh.kv]
            if ranks is not None:  # a tensor-parallel engine's: every rank's heads, stored by rank 0
                kv = [(ranks.gather_heads(k, whole), ranks.gather_heads(v, whole)) for k, v in kv]
                if ranks.rank:
                    continue
            learn = None
            if context is not None:
                known = refs.get(s)  # the plan named a variant this request did not reuse
                learn = (context, (starts[s], starts[s + 1]), tuple(question), known.variant_id if known else "")
            self._pending.append(self._stores.submit(self._store_one, tokens, kv, fresh.prefix, fresh, learn))

    def _store_one(self, tokens, kv, prefix, fresh, learn=None) -> None:  # noqa: ANN001 - background task
        stats = fresh.stats  # computed here, after the request's first token (`engine_adapter.stats`)
        if learn is not None:
            try:
                stats = self._learned(tokens, kv, prefix, stats, *learn)
            except Exception as e:  # noqa: BLE001 - learning never costs the store
                log.warning("kvcraft: learning recompute scores for a chunk failed (%s); storing it without", e)
        try:
            self.client.store(self.model_id, list(tokens), kv, prefix_keys=list(prefix), stats=stats)
        except KVCraftError as e:  # a failed store never fails a request
            log.warning("kvcraft store-back of a chunk failed: %s", e)

    def _learned(self, tokens, kv, prefix, stats: VariantStats, context, span, question,  # noqa: ANN001
                 variant_id: str) -> VariantStats:
        """`stats` with the learned recompute scores of this fresh chunk against a stored
        variant of it behind another prefix (one with scores first, then the plan's, then
        the first the service lists): that variant's scores merged with this request's
        learned scores (`learned.learn`), so the lists accumulate over the requests that
        computed the chunk."""
        key = chunk_key(self.model_id, tokens)
        try:
            infos = self.client.get_chunk(key)
        except KVCraftError as e:
            log.info("kvcraft: no learned scores for chunk %s (%s)", key[:12], e)
            return stats
        mine = tuple(prefix)
        others = [v for v in infos if tuple(v.prefix_keys) != mine and v.token_count == len(tokens)]
        if not others:
            return stats  # the first computation of this chunk: nothing to compare with yet
        # the plan's variant, else any; one with scores first, so that they accumulate
        others.sort(key=lambda v: (not v.stats.recompute_scores, v.variant_id != variant_id))
        info = others[0]
        stored = self.client.fetch(key, info.variant_id)
        if len(stored) != len(kv) or any(k.shape != fk.shape for (k, _), (fk, _) in zip(stored, kv)):
            log.warning("kvcraft: variant %s of chunk %s has another shape; no learned scores",
                        info.variant_id[:12], key[:12])
            return stats
        gain = learned.learn(self.engine, [learned.GainCase(context, span, question, stored, tuple(tokens))])[0]
        scores = merge_scores(tuple(info.stats.recompute_scores), gain.tolist())
        return dataclasses.replace(stats, recompute_scores=scores)

    def flush(self) -> None:
        """Wait for background store-backs and shadow prefills (tests, shutdown)."""
        for f in self._pending:
            f.result()
        self._pending.clear()
        self.fidelity.wait()

    def _add_samples(self) -> None:
        """Finished fidelity samples into the timings the next Plan sends (a failed Plan
        keeps them there for the one after)."""
        room = MAX_SAMPLES_PER_PLAN - len(self._timings.fidelity)
        if room > 0:
            self._timings.fidelity.extend(self.fidelity.take(room))

    def sampling_cost(self) -> SamplingCost:
        """The shadow prefills' compute beside the served requests' (`engine_adapter.fidelity`)."""
        return self.fidelity.cost()

    def _learn(self, source: ServiceLayerSource, result: BlendResult) -> None:
        """Timings for the loading controller (CacheBlend §5), sent with the next Plan: per layer,
        the bytes that came from one tier and the seconds they took. The mapped part's load is
        what the engine waited for it (the tensors alias the service's memory: no bytes move);
        a part from tiers of several speeds says nothing of one."""
        if source.mapped_tier:
            for layer in sorted(source.mapped_seconds):
                self._timings.loads.add(tier=source.mapped_tier, bytes_per_layer=source.mapped_bytes[layer],
                                        seconds=max(source.mapped_seconds[layer], 1e-9))
        tiers = {self._plan_tiers.get(s, "") for s in source.streamed}
        if len(tiers) == 1 and "" not in tiers:
            (tier,) = tiers
            prev = 0.0
            for layer in sorted(source.arrived):
                t = source.arrived[layer]
                self._timings.loads.add(tier=tier, bytes_per_layer=source.layer_bytes.get(layer, 0),
                                        seconds=max(t - prev, 1e-9))
                prev = t
        for t, rows in zip(result.timings, result.computed_rows):
            if rows:
                self._timings.computes.add(tokens_per_layer=rows, seconds=max(t.compute_s, 1e-9))

    def take_timings(self) -> pb.TimingReport:
        """The load/compute timings (and finished fidelity samples) gathered since the last Plan,
        forgotten here: for a caller that plans by itself (the vLLM connector)."""
        self._add_samples()
        out, self._timings = self._timings, pb.TimingReport()
        return out

    def close(self) -> None:
        self.flush()
        self._stores.shutdown()
        self.fidelity.close()
