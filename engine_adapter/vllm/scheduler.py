"""The connector's scheduler side: which blocks the service holds, what to load, what to save.

Bounds (docs/vllm.md "What the connector guarantees"):
- The scheduler never waits on the network. A request's lookup is one MatchPrefix sent
  as a gRPC future the first time vLLM asks about the request; until the answer arrives
  `get_num_new_matched_tokens` returns None ("ask again later": vLLM schedules other
  requests), for at most `lookup_timeout_s`, after which the request counts as 0 hits.
  The answer is kept for the request's lifetime: later scheduling attempts, and a
  resume after preemption, reuse it without another RPC.
- `breaker_failures` consecutive timeouts or errors switch lookups off for
  `retry_after_s` (requests then count as 0 hits at once); the first answer after that
  switches them on again. Timeouts and errors are logged and counted apart.
- Loads are asynchronous (vLLM's WAITING_FOR_REMOTE_KVS): the blocks vLLM allocated in
  `update_state_after_alloc` are loaded by the worker side in the background and the
  request is scheduled when they are in. This covers new requests, requests resumed
  after preemption (vLLM asks again and allocates new blocks), and partial acceptance
  (vLLM accepting fewer tokens than offered: exactly the blocks covering the accepted
  tokens are loaded). A load reported failed lowers the request's kept answer to the
  blocks before the first failed one: vLLM recomputes from there and is not offered the
  failed blocks again (no load-fail-retry loop).
- A step in which vLLM scheduled no token and no load runs waits at most `idle_wait_s`
  for a pending lookup or Plan to be answered (docs/vllm.md "Idle steps"): there is
  nothing to schedule, and vLLM's loop would otherwise spin; not counted as step time.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import grpc

from engine_adapter.vllm.blocks import (BlendLoad, BlockLoad, BlockSave, KVCraftMetadata, KVCraftWorkerMeta,
                                        block_chain, unblended)
from engine_adapter.vllm.blend_request import Blend, computed_share, parse_blend
from engine_adapter.vllm.config import ConnectorSettings
from engine_adapter.vllm.lookup import Breaker, PrefixLookup
from engine_adapter.vllm.metrics import ConnectorMetrics

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvcraft.vllm")


@dataclass
class _Request:
    tokens: list[int]
    keys: list[str]
    vids: list[str]
    lookup: PrefixLookup | None = None
    service_blocks: int | None = None   # leading blocks the service holds (known answer)
    offer_first: int = 0                # blocks offered by the last get_num_new_matched_tokens
    offer_count: int = 0
    offer_tokens: int = 0               # tokens offered (blocks * block size, or token-exact for a blend)
    saved_upto: int = 0                 # blocks [0, saved_upto) were planned for save
    preemptions: int = 0                # vLLM's num_preemptions when last asked
    offer_blend: bool = False           # the last offer was the blend's (else service blocks)
    blend: Blend | None = None          # the request carries chunk boundaries and blending is on


class SchedulerSide:
    """Scheduler-role half of KVCraftConnector (see the module docstring)."""

    def __init__(self, settings: ConnectorSettings, model_id: str, block_size: int, client: Any,
                 block_ids_of: Callable[[str], list[int]], metrics: ConnectorMetrics,
                 chunk_model_id: str = "", num_layers: int = 0, namespaces: Any = None,
                 prefix_blocks: bool = True, last_tokens: bool = True) -> None:
        """namespaces: an `engine_adapter.namespace.NamespaceWatch` told of blends that
        reused nothing (chunks stored under another dtype are reported), or None.
        prefix_blocks: vLLM's blocks are looked up and saved (off: blending alone).
        last_tokens: steps of blended requests' last tokens are named for the blends to answer."""
        self.settings = settings
        self.prefix_blocks = prefix_blocks
        self.last_tokens = last_tokens
        self.namespaces = namespaces
        self.model_id = model_id
        self.chunk_model_id = chunk_model_id
        self.num_layers = num_layers
        self.block_size = block_size
        self._client = client
        self._block_ids_of = block_ids_of
        self.metrics = metrics
        self._reqs: dict[str, _Request] = {}
        self._timings = b""  # the latest finished blend's TimingReport, for the next Plan
        self._loads: list[BlockLoad] = []
        self._blends: list[BlendLoad] = []
        self._loading: dict[str, tuple[int, tuple[int, ...]]] = {}  # req -> (first block, vLLM block ids)
        self._breaker = Breaker(settings, metrics)
        self._step_s = 0.0
        self._answered = threading.Event()  # set when a lookup or Plan RPC ends (idle steps wait on it)

    # -- vLLM's scheduler calls --------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        t0 = time.perf_counter()
        try:
            return self._matched(request, num_computed_tokens)
        finally:
            self._step_s += time.perf_counter() - t0

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        t0 = time.perf_counter()
        try:
            self._after_alloc(request, blocks, num_external_tokens)
        finally:
            self._step_s += time.perf_counter() - t0

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVCraftMetadata:
        t0 = time.perf_counter()
        meta = KVCraftMetadata(loads=self._loads, blends=self._blends,
                               idle=not scheduler_output.total_num_scheduled_tokens)
        self._loads, self._blends = [], []
        for new in scheduler_output.scheduled_new_reqs:
            self._plan_saves(new.req_id, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id],
                             meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self._plan_saves(req_id, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id],
                             meta)
        meta.last_tokens = self._last_tokens(scheduler_output)
        self.metrics.add(planned_saves=len(meta.saves))
        self.metrics.step(self._step_s + time.perf_counter() - t0)
        self._step_s = 0.0
        if meta.idle and not self._loading and self.settings.idle_wait_s > 0:
            self._idle_wait()
        return meta

    def _last_tokens(self, so: "SchedulerOutput") -> tuple[str, ...]:
        """The step's requests where its every token is the last prompt token of a request whose
        blend left it with the worker side, no two alike (the worker answers them: `last_token`),
        each reported as vLLM computing none of its tokens; else ()."""
        if not self.last_tokens:
            return ()
        computed = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        computed.update(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens))
        places, results = set(), []
        for req_id, n in so.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            b = st.blend if st is not None else None
            if n != 1 or b is None or not (st.offer_blend and b.last_ready and b.result) \
                    or computed.get(req_id) != len(st.tokens) - 1:
                return ()
            places.add((len(st.tokens) - 1, st.tokens[-1]))
            results.append(b.result)
        if len(places) < len(results):
            return ()
        for r in results:
            r["vllm_computed_tokens"] = 0
            r["computed_share"] = computed_share(r)
        return tuple(so.num_scheduled_tokens)

    def _idle_wait(self) -> None:
        """vLLM computes nothing this step and no load runs (the worker side waits for
        those): wait at most `idle_wait_s` for a pending lookup or Plan to be answered,
        instead of letting vLLM's loop spin (it would hold the GIL gRPC's thread needs
        to deliver that answer). Not counted in the scheduler step time: idle time."""
        self._answered.clear()
        if any((st.lookup is not None and st.lookup.pending())
               or (st.blend is not None and st.blend.plan is None and st.blend.future is not None
                   and not st.blend.future.done()) for st in self._reqs.values()):
            self._answered.wait(self.settings.idle_wait_s)

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        """A load that failed lowers the request's kept answer to the blocks before the first
        failed one, so vLLM's retry (it recomputes from there) is not offered them again."""
        t0 = time.perf_counter()
        failed = output.invalid_block_ids or set()
        for req_id in output.finished_recving or ():
            first, ids = self._loading.pop(req_id, (0, ()))
            st = self._reqs.get(req_id)
            bad = [i for i, b in enumerate(ids) if b in failed]
            if st is not None and bad:
                if st.blend is not None and st.blend.claimed:
                    st.blend.declined = "the blend failed"  # vLLM recomputes; never offered again
                st.service_blocks = min(st.service_blocks or 0, first + bad[0])
        meta = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVCraftWorkerMeta):
            if meta.timings:
                self._timings = meta.timings
            for req_id, numbers in meta.blends.items():
                st = self._reqs.get(req_id)
                if st is not None and st.blend is not None:
                    st.blend.result = numbers
            for req_id in meta.last_ready:
                st = self._reqs.get(req_id)
                if st is not None and st.blend is not None:
                    st.blend.last_ready = True
        self._step_s += time.perf_counter() - t0

    def request_finished(self, request: "Request") -> dict[str, Any] | None:
        """The request's kv_transfer_params for its RequestOutput: {"kvcraft": numbers} for a
        request that carried chunk boundaries (docs/vllm.md "Blending"), else None."""
        self._loading.pop(request.request_id, None)
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return None
        if st.lookup is not None:
            st.lookup.cancel()
        b = st.blend
        if b is None:
            return None
        if b.future is not None and not b.future.done():
            b.future.cancel()
        b.release(self._client)
        if b.result is not None:
            if b.plan_s is not None:
                b.result.setdefault("timings", {})["plan_s"] = b.plan_s
            return {"kvcraft": b.result}
        return {"kvcraft": unblended(b.policy, len(st.tokens), self.num_layers, b.budget, b.declined or "not blended")}

    def _take_timings(self) -> bytes:
        out, self._timings = self._timings, b""
        return out

    def close(self) -> None:
        for st in self._reqs.values():
            if st.lookup is not None:
                st.lookup.cancel()
        self._reqs.clear()
        if self.namespaces is not None:
            self.namespaces.close()

    # -- lookups -----------------------------------------------------------------------------
    def _matched(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = self._new_request(request)
        st.offer_count, st.offer_blend = 0, False
        preemptions = int(getattr(request, "num_preemptions", 0) or 0)
        if preemptions > st.preemptions:
            st.preemptions = preemptions
            self.metrics.add(resumed_requests=1)  # back after a preemption: the kept answer serves it
        bs = self.block_size
        if st.blend is not None and not st.blend.declined:
            got = self._blend_matched(st, num_computed_tokens)
            if got != (0, False):
                return got
        if not st.vids or num_computed_tokens % bs:
            return 0, False
        if st.service_blocks is None:
            known = self._answer(st)
            if known is None:
                return None, False  # pending: vLLM asks again next step, other requests go on
            st.service_blocks = known
        # vLLM computes at least the last prompt token itself.
        usable = min(st.service_blocks, (len(st.tokens) - 1) // bs)
        first = num_computed_tokens // bs
        if usable <= first:
            return 0, False
        st.offer_first, st.offer_count = first, usable - first
        st.offer_tokens = st.offer_count * bs
        return st.offer_tokens, True

    def _new_request(self, request: "Request") -> _Request:
        tokens = list(request.prompt_token_ids or [])
        unsupported = (getattr(request, "lora_request", None) is not None or getattr(request, "mm_features", None)
                       or getattr(request, "prompt_embeds", None) is not None)
        if unsupported:  # neither loaded nor saved
            return _Request(tokens, [], [], service_blocks=0, saved_upto=len(tokens) // self.block_size)
        keys, vids = block_chain(self.model_id, tokens, self.block_size) if self.prefix_blocks else ([], [])
        return _Request(tokens, keys, vids, blend=parse_blend(request, tokens, self.settings, self.metrics))

    # -- blending ----------------------------------------------------------------------------
    def _blend_matched(self, st: _Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens the blend offers: every prompt token but the last, from vLLM's computed
        prefix on (token-exact: vLLM v1 takes external tokens that end inside a block).

        Not only the chunks: the blend computes the question rows anyway (Cache-Craft's focus
        reads their attention, and the reference engine's blended KV includes them), so their
        K/V are written too and vLLM computes only the last token (it needs its logits)."""
        b = st.blend
        assert b is not None
        bs = self.block_size
        if num_computed_tokens % bs:
            return 0, False
        if b.plan is None:
            answer = b.ask_plan(st.tokens, self._client, self.chunk_model_id, self.settings, self.metrics,
                                self._breaker, on_done=self._answered.set, take_timings=self._take_timings)
            if answer is None:
                return None, False
            if not answer:
                return 0, False
            if not b.reused_chunks and self.namespaces is not None:
                self.namespaces.check_missed(st.tokens[:b.chunk_tokens[0]])
        end = len(st.tokens) - 1
        if end <= num_computed_tokens:
            return 0, False
        if not b.reused_chunks and not self.settings.blend_store_back:
            b.declined = "no chunk is stored and blend_store_back is off"
            b.release(self._client)
            return 0, False
        st.offer_first, st.offer_count = num_computed_tokens // bs, -(-(end - num_computed_tokens) // bs)
        st.offer_tokens, st.offer_blend = end - num_computed_tokens, True
        return end - num_computed_tokens, True

    def _answer(self, st: _Request) -> int | None:
        now = time.monotonic()
        if st.lookup is None:
            if self._breaker.is_off():
                self.metrics.add(lookups_skipped=1)
                return 0
            self.metrics.add(lookups=1)
            try:
                st.lookup = PrefixLookup(self._client, st.vids, now + self.settings.lookup_timeout_s,
                                         on_done=self._answered.set)
            except Exception as e:  # noqa: BLE001 - a lookup that cannot start is a miss
                self._breaker.failed("error", f"{type(e).__name__}: {e}")
                return 0
        try:
            n = st.lookup.poll()
        except Exception as e:  # noqa: BLE001 - any failure means "no hit", never a crash
            timeout = getattr(e, "code", None) == grpc.StatusCode.DEADLINE_EXCEEDED
            self._breaker.failed("timeout" if timeout else "error", str(e))
            return st.lookup.matched
        if n is None:
            if now < st.lookup.deadline:
                return None
            st.lookup.cancel()
            self._breaker.failed("timeout", f"no answer within {self.settings.lookup_timeout_s:.2f}s")
            return st.lookup.matched
        self._breaker.answered()
        return n

    # -- loads and saves ---------------------------------------------------------------------
    def _after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0 or st.offer_count <= 0:
            if st is not None:
                st.offer_count = 0
            return
        bs = self.block_size
        n_blocks = -(-num_external_tokens // bs)  # a partly accepted block is loaded whole; vLLM overwrites the rest
        if num_external_tokens > st.offer_tokens:
            raise RuntimeError(f"vLLM accepted {num_external_tokens} tokens of request {request.request_id}, "
                               f"more than the {st.offer_tokens} kvcraft offered")
        a, b = st.offer_first, st.offer_first + n_blocks
        ids = tuple(blocks.get_block_ids()[0][a:b])
        bl = st.blend
        if st.offer_blend and bl is not None and bl.plan is not None:
            self._blends.append(BlendLoad(request.request_id, ids, a * bs, num_external_tokens, tuple(st.tokens),
                                          bl.chunk_tokens, bl.plan, bl.policy, bl.options))
            bl.claimed, bl.last_ready = num_external_tokens, False
            st.saved_upto = len(st.tokens) // bs  # blended KV is never saved as exact prefix blocks
            self.metrics.add(blend_requests=1, blend_claimed_tokens=num_external_tokens)
        else:
            self._loads.append(BlockLoad(request.request_id, ids, tuple(st.keys[a:b]), tuple(st.vids[a:b]),
                                         num_external_tokens))
            self.metrics.add(promised_tokens=num_external_tokens, promised_blocks=n_blocks)
        self._loading[request.request_id] = (a, ids)
        if num_external_tokens < st.offer_tokens:
            self.metrics.add(partial_accepts=1)
        st.offer_count = 0

    def _plan_saves(self, req_id: str, computed_end: int, meta: KVCraftMetadata) -> None:
        """Full prompt blocks whose KV exists after this step and the service lacks. Each is
        planned once per request; the worker side skips blocks already stored or in flight,
        and a failed save is planned again by the next request that computes the block."""
        st = self._reqs.get(req_id)
        if st is None or not st.vids:
            return
        bs = self.block_size
        upto = min(computed_end, len(st.tokens)) // bs
        first = max(st.saved_upto, st.service_blocks or 0)
        if upto <= first:
            return
        ids = self._block_ids_of(req_id)
        upto = min(upto, len(ids), len(st.vids))
        for b in range(first, upto):
            meta.saves.append(BlockSave(ids[b], tuple(st.tokens[b * bs:(b + 1) * bs]),
                                        st.vids[b - 1] if b else "", st.vids[b]))
        st.saved_upto = max(st.saved_upto, upto)
