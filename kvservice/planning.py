"""Glue between the store and the planner, and the Plan RPC's core (no gRPC here).

The planner reads the store's own variant index (`kvservice.index`, one index for
both). The store tells `PlanningService` of every put / evict (it is a
StoreListener, called under the store's lock) so the planner's CP-Tree follows; the
service answers Plan requests: plan, lease what the plan reuses, start preloading it
toward the fastest tier.
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor

from kvcraft.keys import chunk_key, is_key
from kvcraft.plans import KeyTable
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.errors import InvalidArgument, NotFound, Unavailable, check_key
from kvservice.fidelity import Sample
from kvservice.index import Variant
from kvservice.planner import ChunkPlan, ChunkRef, Planner, PlannerConfig
from kvservice.planner.plan import FRESH, PREFIX, PlanError
from kvservice.store import ChunkStore

_SOURCE = {FRESH: pb.ChunkPlan.FRESH, PREFIX: pb.ChunkPlan.PREFIX, "variant": pb.ChunkPlan.VARIANT}


class PlanningService:
    def __init__(self, store: ChunkStore, config: PlannerConfig = PlannerConfig()) -> None:
        self.store = store
        self.catalog = store.index
        self.planner = Planner(self.catalog, config, tiers=[t.name for t in store.tiers])
        # The planner is not thread-safe; store hooks arrive from worker threads (with
        # the store's lock held: lock order is store, then this one).
        self._lock = threading.Lock()
        with self._lock:
            self._restore_prefixes(list(store.index))
        store.listeners.append(self)

    def _restore_prefixes(self, infos: list[Variant]) -> None:
        """Rebuild the CP-Tree after a restart (CRAFT §4.1 keeps it in memory).

        A stored variant of chunk C behind [A, B] is exact KV for the prompt prefix
        A, B, C when A is stored alone and B behind [A]: every such fully stored chain
        is a chunk-prefix the planner may reuse without recompute.
        """
        stored = {(i.chunk_key, tuple(i.prefix_keys)): i.token_count for i in infos}
        for info in sorted(infos, key=lambda i: len(i.prefix_keys)):
            path = (*info.prefix_keys, info.chunk_key)
            counts = [stored.get((path[j], path[:j])) for j in range(len(path))]
            if all(counts):
                self.planner.restore_prefix(path, counts)

    # -- StoreListener ------------------------------------------------------------------
    def on_put(self, variant: Variant) -> None:
        with self._lock:
            self.planner.on_put(variant)

    def on_evict(self, variant_id: str) -> None:
        with self._lock:
            self.planner.on_evict(variant_id)

    # -- Plan ---------------------------------------------------------------------------
    def plan(self, req: pb.PlanRequest, preload: Executor | None = None, _retried: bool = False) -> pb.PlanResponse:
        check_key("model_id", req.model_id)
        if not req.chunks:
            raise InvalidArgument("chunks is empty: a RAG request names at least one retrieved chunk")
        if len(req.chunks) > self.store.cfg.max_fetch_variants:
            raise InvalidArgument(f"{len(req.chunks)} chunks; at most {self.store.cfg.max_fetch_variants}")
        refs = [self._chunk_ref(req.model_id, i, c) for i, c in enumerate(req.chunks)]
        if self.store.cluster is not None:  # variants other nodes stored (docs/scale-out.md)
            self.store.cluster.discover([r.key for r in refs])
        first = req.first_turn if req.HasField("first_turn") else None
        loads, computes = req.timings.loads, req.timings.computes
        if loads:
            tiers = [t.name for t in self.store.tiers]
            for i, t in enumerate(loads):
                if t.tier not in tiers:
                    raise InvalidArgument(f"timings.loads[{i}].tier is {t.tier!r}; this service's tiers are {tiers}")
        with self._lock:
            for t in loads:
                self.planner.observe_load(req.model_id, t.tier, t.bytes_per_layer, t.seconds)
            for t in computes:
                self.planner.observe_compute(req.model_id, t.tokens_per_layer, t.seconds)
            try:
                plan = self.planner.plan(req.model_id, req.conversation_id, refs, req.question_tokens, first)
            except PlanError as e:
                raise InvalidArgument(str(e)) from None
        reused = [c.variant_id for c in plan.chunks if c.variant_id is not None]
        lease_id, expires = "", 0.0
        if reused:
            try:
                lease_id, expires = self.store.lease_variants(reused, req.lease_ttl_s)
            except NotFound:
                # Evicted between planning and leasing (the hooks have already removed it
                # from the catalog): plan once more; a second miss is a real inconsistency.
                if _retried:
                    raise Unavailable("variants keep disappearing while planning; retry the request") from None
                return self.plan(req, preload, _retried=True)
            if preload is not None:
                todo = self._to_preload(plan.chunks)
                if todo:
                    preload.submit(self.store.promote, todo)
        history, order = plan.history, plan.order
        resp = pb.PlanResponse(order=order, dropped=plan.dropped, history=history, ratio=plan.ratio,
                               preload_depth=plan.preload_depth, load_s_per_layer=plan.load_s_per_layer,
                               compute_s_per_layer=plan.compute_s_per_layer, lease_id=lease_id,
                               lease_expires_unix_ms=int(expires * 1000), computed_tokens=plan.computed_tokens)
        add = resp.chunks.add  # add(**fields) builds each ChunkPlan in place: the cheapest way with upb
        get = self.catalog.get
        table = KeyTable(history, order)  # each key sent once (kvcraft.plans)
        for c in plan.chunks:
            vid = c.variant_id
            info = get(vid) if vid else None
            chain, length = table.chain(info.prefix_keys) if info is not None else (0, 0)
            add(chunk_key=c.chunk_key, position=c.position, token_start=c.token_span[0], token_count=c.token_count,
                source=_SOURCE[c.source], variant_id=vid or "", tier=c.tier or "", cfo=c.cfo, recompute=c.recompute,
                variant_prefix_chain=chain, variant_prefix_length=length)
        resp.other_keys.extend(table.other)
        for ranges in table.chain_ranges():
            resp.variant_prefixes.add(ranges=ranges)
        if req.timings.fidelity:  # here, once: a retried plan above returns the retry's answer
            self.store.fidelity.observe(req.model_id, [Sample(s.policy, s.top1_agree, s.kl, s.computed_share, s.budget,
                                                              s.answer_tokens, s.answer_agree, s.shadow_blend,
                                                              s.lead if s.HasField("lead") else None)
                                                       for s in req.timings.fidelity])
        if req.policy:  # after the samples: the budget follows what they say
            d = self.store.fidelity.decide(req.model_id, req.policy, req.adaptive)
            resp.recompute_budget, resp.fidelity_sample, resp.fidelity_below = d.budget, d.sample, d.below
            resp.no_reuse, resp.near_tie = d.no_reuse, d.near_tie
        return resp

    def _to_preload(self, chunks: tuple[ChunkPlan, ...]) -> list[str]:
        """Reused variants worth copying into the fastest tier: not there yet, and not
        larger than that tier's whole budget (those could never be admitted)."""
        fast = self.store.tiers[0]
        out = []
        for c in chunks:
            if c.variant_id is not None and c.tier != fast.name:
                info = self.catalog.get(c.variant_id)
                if info is not None and info.size_bytes <= fast.budget_bytes:
                    out.append(c.variant_id)
        return out

    @staticmethod
    def _chunk_ref(model_id: str, i: int, c: pb.PlanChunk) -> ChunkRef:
        if c.token_ids:
            key = chunk_key(model_id, c.token_ids)
            if c.chunk_key and c.chunk_key != key:
                raise InvalidArgument(f"chunks[{i}].chunk_key does not match its token_ids")
            return ChunkRef(key, len(c.token_ids))
        if not is_key(c.chunk_key):
            raise InvalidArgument(f"chunks[{i}] needs token_ids, or a chunk_key (32 hex chars) and token_count")
        if c.token_count < 1:
            raise InvalidArgument(f"chunks[{i}].token_count is {c.token_count}; expected >= 1")
        return ChunkRef(c.chunk_key, c.token_count)
