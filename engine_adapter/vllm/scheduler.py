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
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import grpc

from engine_adapter.vllm.blocks import BlockLoad, BlockSave, KVCraftMetadata, block_chain
from engine_adapter.vllm.config import ConnectorSettings
from engine_adapter.vllm.metrics import ConnectorMetrics
from kvclient.errors import from_rpc_error

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvcraft.vllm")

MAX_IDS_PER_LOOKUP = 256  # the service's max_fetch_variants


class _Lookup:
    """One request's MatchPrefix, possibly over several RPCs of <= MAX_IDS_PER_LOOKUP ids."""

    def __init__(self, client: Any, vids: list[str], deadline: float) -> None:
        self._client = client
        self._vids = vids
        self.deadline = deadline
        self.matched = 0
        self._future = self._send()

    def _send(self) -> Any:
        part = self._vids[self.matched:self.matched + MAX_IDS_PER_LOOKUP]
        return self._client.match_prefix_future(part, timeout=max(0.001, self.deadline - time.monotonic()))

    def poll(self) -> int | None:
        """Blocks matched, or None while the answer is pending. Raises what the RPC raised."""
        if not self._future.done():
            return None
        try:
            got = self._future.result().matched
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        asked = min(MAX_IDS_PER_LOOKUP, len(self._vids) - self.matched)
        self.matched += got
        if got == asked and self.matched < len(self._vids) and time.monotonic() < self.deadline:
            self._future = self._send()
            return None
        return self.matched

    def cancel(self) -> None:
        self._future.cancel()


@dataclass
class _Request:
    tokens: list[int]
    keys: list[str]
    vids: list[str]
    lookup: _Lookup | None = None
    service_blocks: int | None = None   # leading blocks the service holds (known answer)
    offer_first: int = 0                # blocks offered by the last get_num_new_matched_tokens
    offer_count: int = 0
    saved_upto: int = 0                 # blocks [0, saved_upto) were planned for save
    preemptions: int = 0                # vLLM's num_preemptions when last asked


class SchedulerSide:
    """Scheduler-role half of KVCraftConnector (see the module docstring)."""

    def __init__(self, settings: ConnectorSettings, model_id: str, block_size: int, client: Any,
                 block_ids_of: Callable[[str], list[int]], metrics: ConnectorMetrics) -> None:
        self.settings = settings
        self.model_id = model_id
        self.block_size = block_size
        self._client = client
        self._block_ids_of = block_ids_of
        self.metrics = metrics
        self._reqs: dict[str, _Request] = {}
        self._loads: list[BlockLoad] = []
        self._loading: dict[str, tuple[int, tuple[int, ...]]] = {}  # req -> (first block, vLLM block ids)
        self._failures = 0
        self._off_until = 0.0
        self._off_logged = False
        self._step_s = 0.0

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
        meta = KVCraftMetadata(loads=self._loads)
        self._loads = []
        for new in scheduler_output.scheduled_new_reqs:
            self._plan_saves(new.req_id, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id],
                             meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self._plan_saves(req_id, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id],
                             meta)
        self.metrics.add(planned_saves=len(meta.saves))
        self.metrics.step(self._step_s + time.perf_counter() - t0)
        self._step_s = 0.0
        return meta

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
                st.service_blocks = min(st.service_blocks or 0, first + bad[0])
        self._step_s += time.perf_counter() - t0

    def request_finished(self, request: "Request") -> None:
        self._loading.pop(request.request_id, None)
        st = self._reqs.pop(request.request_id, None)
        if st is not None and st.lookup is not None:
            st.lookup.cancel()

    def close(self) -> None:
        for st in self._reqs.values():
            if st.lookup is not None:
                st.lookup.cancel()
        self._reqs.clear()

    # -- lookups -----------------------------------------------------------------------------
    def _matched(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = self._new_request(request)
        st.offer_count = 0
        preemptions = int(getattr(request, "num_preemptions", 0) or 0)
        if preemptions > st.preemptions:
            st.preemptions = preemptions
            self.metrics.add(resumed_requests=1)  # back after a preemption: the kept answer serves it
        bs = self.block_size
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
        return st.offer_count * bs, True

    def _new_request(self, request: "Request") -> _Request:
        tokens = list(request.prompt_token_ids or [])
        unsupported = (getattr(request, "lora_request", None) is not None or getattr(request, "mm_features", None)
                       or getattr(request, "prompt_embeds", None) is not None)
        if unsupported:  # neither loaded nor saved
            return _Request(tokens, [], [], service_blocks=0, saved_upto=len(tokens) // self.block_size)
        keys, vids = block_chain(self.model_id, tokens, self.block_size)
        return _Request(tokens, keys, vids)

    def _answer(self, st: _Request) -> int | None:
        now = time.monotonic()
        if st.lookup is None:
            if now < self._off_until:
                self.metrics.add(lookups_skipped=1)
                return 0
            self.metrics.add(lookups=1)
            try:
                st.lookup = _Lookup(self._client, st.vids, now + self.settings.lookup_timeout_s)
            except Exception as e:  # noqa: BLE001 - a lookup that cannot start is a miss
                self._failed("error", f"{type(e).__name__}: {e}")
                return 0
        try:
            n = st.lookup.poll()
        except Exception as e:  # noqa: BLE001 - any failure means "no hit", never a crash
            timeout = getattr(e, "code", None) == grpc.StatusCode.DEADLINE_EXCEEDED
            self._failed("timeout" if timeout else "error", str(e))
            return st.lookup.matched
        if n is None:
            if now < st.lookup.deadline:
                return None
            st.lookup.cancel()
            self._failed("timeout", f"no answer within {self.settings.lookup_timeout_s:.2f}s")
            return st.lookup.matched
        self._failures = 0
        if self._off_logged:
            log.warning("kvcraft: service at %s answers prefix lookups again", self.settings.address)
            self._off_logged = False
        return n

    def _failed(self, kind: str, why: str) -> None:
        self.metrics.add(**{"lookup_timeouts" if kind == "timeout" else "lookup_errors": 1})
        self._failures += 1
        if self._failures >= self.settings.breaker_failures and time.monotonic() >= self._off_until:
            self._off_until = time.monotonic() + self.settings.retry_after_s
            if not self._off_logged:
                what = "did not answer a prefix lookup in time" if kind == "timeout" else "failed a prefix lookup"
                log.warning("kvcraft: service at %s %s (%s: %s), %d times in a row; vLLM computes these "
                            "prompts itself, lookups off for %.1fs", self.settings.address, what, kind,
                            why[:200], self._failures, self.settings.retry_after_s)
                self._off_logged = True

    # -- loads and saves ---------------------------------------------------------------------
    def _after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0 or st.offer_count <= 0:
            if st is not None:
                st.offer_count = 0
            return
        bs = self.block_size
        n_blocks = -(-num_external_tokens // bs)  # a partly accepted block is loaded whole; vLLM overwrites the rest
        if n_blocks > st.offer_count:
            raise RuntimeError(f"vLLM accepted {num_external_tokens} tokens of request {request.request_id}, "
                               f"more than the {st.offer_count * bs} kvcraft offered")
        a, b = st.offer_first, st.offer_first + n_blocks
        ids = tuple(blocks.get_block_ids()[0][a:b])
        self._loads.append(BlockLoad(request.request_id, ids, tuple(st.keys[a:b]), tuple(st.vids[a:b]),
                                     num_external_tokens))
        self._loading[request.request_id] = (a, ids)
        if num_external_tokens < st.offer_count * bs:
            self.metrics.add(partial_accepts=1)
        st.offer_count = 0
        self.metrics.add(promised_tokens=num_external_tokens, promised_blocks=n_blocks)

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
