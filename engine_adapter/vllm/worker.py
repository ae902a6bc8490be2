"""The connector's worker side: background loads into vLLM's paged KV, batched saves out of it.

Loads: each request's load (blocks vLLM allocated and will not touch until the load is reported finished) runs
on a loader thread (on a CPU and at tensor parallel > 1 blends run in `start_loads` itself, one a step, on vLLM's
step thread after the step's forward pass, each reported in the step that ran it: on a CPU that thread's OpenMP
team has the cores, `engine_adapter.threads`; at tensor parallel > 1 vLLM calls every rank there with the same
metadata, so the ranks' blends call vLLM's collectives in one order): one `engine_adapter.loader.ServiceLayerSource`
(the service's shared memory when `local` and it runs on this host, else one FetchLayers stream), the blocks checked
once (shape, dtype), then per layer the request's blocks gathered into one [blocks, heads, block, hd] tensor and
scattered into vLLM's cache with one `index_copy_` for K and one for V (after one host-to-device copy where the
cache is on a GPU). The forward pass never waits for it. When it ends, `finished_recving` names the request; if
it failed or missed `load_timeout_s`, the same step reports its blocks through `get_block_ids_with_load_errors`
and vLLM (policy "recompute") recomputes them. The request's blocks stay allocated until that report, so a late
write never lands in a block vLLM gave to another request (an aborted request's blocks are freed only then). A
step in which vLLM computes nothing while loads run first waits (at most `idle_wait_s`, ending as soon as one
finishes) before answering which ended: vLLM's engine loop otherwise spins through thousands of empty steps a
second, and with the engine in the loaders' process each of those steps holds the GIL the loader threads need,
so the loads the engine waits for would crawl (docs/vllm.md "Idle steps"). A finished blend's last prompt token
is held for the step that answers it (`last_token`).

Saves: at layer 0 of a step the worker takes the step's planned blocks that are not already stored or in flight
here; each layer's rows of those blocks are copied out (one index_select per layer, so vLLM may reuse the blocks
at once); `wait_for_save` hands the step's blocks to a pool of `save_concurrency` threads that Store them. A
failed Store forgets the block (a later request plans it again); a step in which not every layer reached
`save_kv_layer` saves nothing and says so (counted and logged). `shutdown` waits up to `shutdown_drain_s` for
queued saves, drops the rest (counted), then closes the channel and joins its threads; nothing is logged as an
error. It returns within shutdown_drain_s plus the time a loader needs to see its closed stream.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from engine_adapter.loader import ServiceLayerSource
from engine_adapter.threads import one_omp_thread
from engine_adapter.vllm.blocks import (BlendLoad, BlockLoad, BlockSave, KVCraftMetadata, KVCraftWorkerMeta,
                                        block_mismatch, kv_views, unblended)
from engine_adapter.vllm.config import ConnectorSettings
from engine_adapter.vllm.holds import BlendHolds
from engine_adapter.vllm.metrics import ConnectorMetrics
from kvcraft.keys import ModelSpec
from kvcraft.records import Ref

log = logging.getLogger("kvcraft.vllm")

REMEMBERED_STORED = 8192  # recently confirmed saves not copied again (the scheduler's lookup catches evictions)


class WorkerSide:
    """Worker-role half of KVCraftConnector (see the module docstring)."""

    def __init__(self, settings: ConnectorSettings, spec: ModelSpec, model_id: str, block_size: int, client: Any,
                 metrics: ConnectorMetrics, context: Any = None, in_step: bool = False) -> None:
        """in_step: blends run in `start_loads` itself, one a step, on vLLM's step thread (a CPU: its OpenMP
        team has the cores; tensor parallel > 1: every rank calls vLLM's collectives in one order)."""
        self.settings = settings
        self.in_step = in_step
        self.context = context  # context.ContextBuilder when blending is on
        self._blend_results: dict[str, dict[str, Any]] = {}
        self.layer_names: list[str] = []
        self.spec = spec
        self.model_id = model_id
        self.block_size = block_size
        self._client = client
        self.metrics = metrics
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._layer_index: dict[str, int] = {}
        self.loader = ThreadPoolExecutor(max_workers=settings.load_concurrency, thread_name_prefix="kvcraft-load",
                                         initializer=one_omp_thread)
        self._lock = threading.Lock()
        self._sources: set[ServiceLayerSource] = set()
        self._local = settings.local  # off for good once the service's memory proves to be on another host
        self._finished: set[str] = set()
        self._failed: dict[str, set[int]] = {}
        self._report_failed: set[int] = set()
        self._closing = False
        self._running = 0  # loads and blends handed to the loader threads and not ended
        self._step_blends: deque[tuple[BlendLoad, float]] = deque()  # in_step: (blend, queued at), one a step
        # the blended requests the fidelity shadows give way to, until vLLM hands out their first token
        self.holds = BlendHolds(context.serving) if context is not None else None
        self._progress = threading.Condition(self._lock)  # notified when one ends
        # saves
        self._inflight: set[str] = set()
        self._stored: OrderedDict[str, None] = OrderedDict()
        self._step_saves: list[BlockSave] = []
        self._step_rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._incomplete_logged = False
        self._saver = ThreadPoolExecutor(max_workers=settings.save_concurrency, thread_name_prefix="kvcraft-save",
                                         initializer=one_omp_thread)
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        self._save_failing = False
        self.shutdown_s: float | None = None  # how long shutdown() took

    # -- KV cache layout -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        def index(name: str) -> int:
            m = re.search(r"layers\.(\d+)\.", name)
            return int(m.group(1)) if m else 0

        names = sorted(kv_caches, key=index)
        self._layers = [kv_views(kv_caches[n], self.block_size, self.spec.num_kv_heads, self.spec.head_dim) for n in names]
        self._layer_index = {n: i for i, n in enumerate(names)}
        self.layer_names = names

    # -- loads -------------------------------------------------------------------------------
    def start_loads(self, meta: KVCraftMetadata) -> None:
        now = time.perf_counter()  # the step's blends queue from here
        if self.holds is not None:
            self.holds.step_starts()
        for ld in meta.loads:
            if self._closing:
                self._finish(ld, "shutting down")
            else:
                self._start(self._load, ld)
        for bl in meta.blends:
            if self._closing or self.context is None:
                self._finish_blend(bl, None, "shutting down" if self._closing else "blending is off here")
            elif self.in_step:
                self._step_blends.append((bl, now))
            else:
                self._start(self._blend, bl, now)
        if self.in_step:
            self._step_blend()

    def _step_blend(self) -> None:
        """in_step: one blend a step (every rank the same one, in arrival order), reported in that
        step: the requests vLLM runs wait for one blend at most, not for all that arrived together.
        Once shutting down, every blend not started is reported failed instead."""
        with self._lock:
            dropped = list(self._step_blends) if self._closing else []
            if dropped:
                self._step_blends.clear()
            turn = self._step_blends.popleft() if self._step_blends else None
        for bl, _ in dropped:
            self._finish_blend(bl, None, "shutting down")
        if turn is not None:
            self._blend(*turn)

    def _start(self, fn: Any, *args: Any) -> None:
        with self._lock:
            self._running += 1
        self.loader.submit(self._ran, fn, *args)

    def _ran(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        finally:
            with self._lock:
                self._running -= 1
                self._progress.notify_all()

    def _blend(self, bl: BlendLoad, queued: float) -> None:
        assert self.context is not None
        t0 = time.perf_counter()
        self.holds.begin(bl.req_id)  # until vLLM hands out the request's first token
        try:
            numbers, why = self.context.build(bl, self.layer_names), ""
        except Exception as e:  # noqa: BLE001 - reported as a failed load: vLLM recomputes the request
            numbers, why = None, f"{type(e).__name__}: {e}"[:300]
        t1 = time.perf_counter()
        self.metrics.add(blend_s=t1 - t0)
        if numbers is not None:
            numbers["timings"] = {"queue_s": t0 - queued, "build_s": t1 - t0, **numbers.get("timings", {})}
        self._finish_blend(bl, numbers, why)

    def _finish_blend(self, bl: BlendLoad, numbers: dict[str, Any] | None, why: str) -> None:
        if numbers is None:
            numbers = {**unblended(bl.policy, len(bl.prompt), len(self._layers), bl.plan.recompute_budget, why),
                       "ranks": 1}
        with self._lock:
            self._finished.add(bl.req_id)
            self._blend_results[bl.req_id] = numbers
            if why:
                self._failed.setdefault(bl.req_id, set()).update(bl.block_ids)
        if why:
            self.metrics.add(blend_failed=1, blend_failed_tokens=bl.tokens)
            log.warning("kvcraft: building the context of request %s by blending failed (%s); vLLM computes "
                        "the request alone", bl.req_id, why)
        else:
            self.metrics.add(blend_built_tokens=bl.tokens, blend_row_layers=numbers["kvcraft_row_layers"])

    def worker_meta(self) -> KVCraftWorkerMeta | None:
        """Numbers of the blends that finished since the last call, the latest one's timings, the
        requests whose blend left its last token here (for the scheduler side)."""
        ready = self.context.last_tokens.take_ready() if self.context else set()
        with self._lock:
            out, self._blend_results = self._blend_results, {}
        if not out and not ready:
            return None
        return KVCraftWorkerMeta(blends=out, timings=self.context.take_timings() if self.context else b"",
                                 last_ready=ready)

    def _load(self, ld: BlockLoad) -> None:
        why, source = "", None
        n, timeout = len(ld.block_ids), self.settings.load_timeout_s
        try:
            source = ServiceLayerSource(self._client, dict(enumerate(map(Ref, ld.chunk_keys, ld.variant_ids))),
                                        local=self._local, deadline=time.monotonic() + timeout,
                                        depth=2, name="kvcraft-load")
            with self._lock:
                self._sources.add(source)
            if source.elsewhere and self._local:
                self._local = False
                log.warning("kvcraft: the service at %s is not on this host (its shared memory cannot be mapped: "
                            "%s); loads stream over gRPC from now on", self.settings.address, source.local_error)
            ids = None
            for i, (kc, vc) in enumerate(self._layers):  # kc, vc: [blocks, heads, block, hd] views
                got = source.wait_layer(i)
                if len(got) < n:
                    why = source.error or f"layer {i} not complete within load_timeout_s={timeout}s"
                    break
                if ids is None:  # a variant's layers share one shape and dtype: the first layer tells
                    why = block_mismatch(got.values(), tuple(kc.shape[1:]), kc.dtype, vc.dtype)
                    if why:
                        break
                    ids = torch.tensor(ld.block_ids, dtype=torch.long, device=kc.device)
                k = torch.stack([got[j][0] for j in range(n)]).to(kc.device)  # [n, heads, block, hd]
                v = torch.stack([got[j][1] for j in range(n)]).to(vc.device)
                kc.index_copy_(0, ids, k)
                vc.index_copy_(0, ids, v)
        except Exception as e:  # noqa: BLE001 - reported as a failed load, vLLM recomputes
            why = f"{type(e).__name__}: {e}"[:300]
        finally:
            if source is not None:
                source.close()
                with self._lock:
                    self._sources.discard(source)
        if not why and source is not None:
            self.metrics.add(loaded_shared_blocks=len(source.mapped), loaded_streamed_blocks=len(source.streamed))
        self._finish(ld, why)

    def _finish(self, ld: BlockLoad, why: str) -> None:
        with self._lock:
            self._finished.add(ld.req_id)
            if why:
                self._failed.setdefault(ld.req_id, set()).update(ld.block_ids)
        if why:
            self.metrics.add(failed_load_tokens=ld.tokens, failed_load_blocks=len(ld.block_ids))
            log.warning("kvcraft: loading %d blocks from %s failed (%s); vLLM recomputes them",
                        len(ld.block_ids), self.settings.address, why)
        else:
            self.metrics.add(loaded_tokens=ld.tokens)

    def finished_loads(self, wait: bool = False) -> set[str]:
        """Requests whose load ended (ok or failed) since the last call; their failed blocks
        become what `failed_blocks` returns next (vLLM asks right after, same step).
        wait: none ended yet but loads run: wait at most `idle_wait_s` for one to end."""
        with self._lock:
            if wait and not self._finished and self._running and self.settings.idle_wait_s > 0:
                self._progress.wait(self.settings.idle_wait_s)
            done, self._finished = self._finished, set()
            for r in done:
                self._report_failed |= self._failed.pop(r, set())
        if self.holds is not None:
            self.holds.reported(done)
        return done

    def failed_blocks(self) -> set[int]:
        with self._lock:
            out, self._report_failed = self._report_failed, set()
        return out

    # -- saves -------------------------------------------------------------------------------
    def save_layer(self, meta: KVCraftMetadata, layer_name: str) -> None:
        i = self._layer_index.get(layer_name)
        if i is None or not meta.saves:
            return
        if i == 0:
            self._release(self._step_saves, stored=False)
            self._step_saves = [s for s in meta.saves if self._claim(s.variant_id)]
            self._step_rows = []
        if not self._step_saves:
            return
        kc, vc = self._layers[i]
        ids = torch.tensor([s.block_id for s in self._step_saves], dtype=torch.long, device=kc.device)
        # copies now, so vLLM may reuse the blocks before the Store is sent; [n, heads, block, hd]
        self._step_rows.append((kc.index_select(0, ids).cpu(), vc.index_select(0, ids).cpu()))

    def submit_saves(self) -> None:
        saves, rows = self._step_saves, self._step_rows
        self._step_saves, self._step_rows = [], []
        if not saves:
            return
        if len(rows) != len(self._layers):
            self._release(saves, stored=False)
            self.metrics.add(incomplete_save_steps=1)
            if not self._incomplete_logged:
                log.warning("kvcraft: %d of %d layers reached save_kv_layer in a step; its %d blocks are not "
                            "saved (a later request saves them)", len(rows), len(self._layers), len(saves))
                self._incomplete_logged = True
            return
        for j, s in enumerate(saves):
            with self._lock:
                full = self._closing or self._pending >= self.settings.max_pending_saves
                if not full:
                    self._pending += 1
            if full:
                self._release([s], stored=False)
                self.metrics.add(dropped_saves=1)
                continue
            self._saver.submit(self._store, s, [(k[j], v[j]) for k, v in rows])  # [heads, block, hd] each

    def _claim(self, vid: str) -> bool:
        with self._lock:
            if vid in self._inflight or vid in self._stored:
                dup = True
            else:
                self._inflight.add(vid)
                dup = False
        if dup:
            self.metrics.add(duplicate_saves=1)
        return not dup

    def _release(self, saves: list[BlockSave], stored: bool) -> None:
        with self._lock:
            for s in saves:
                self._inflight.discard(s.variant_id)
                if stored:
                    self._stored[s.variant_id] = None
                    self._stored.move_to_end(s.variant_id)
                    if len(self._stored) > REMEMBERED_STORED:
                        self._stored.popitem(last=False)

    def _store(self, save: BlockSave, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        ok = False
        try:
            if self._closing:
                self.metrics.add(dropped_saves=1)
                return
            r = self._client.store(self.model_id, list(save.token_ids), layers,
                                   prefix_keys=[save.prefix_vid] if save.prefix_vid else [])
            if r.variant_id != save.variant_id:
                raise RuntimeError(f"service named the block {r.variant_id}, expected {save.variant_id}")
            ok = True
            self.metrics.add(saved_blocks=1)
            if self._save_failing:
                self._save_failing = False
                log.warning("kvcraft: storing blocks in %s works again", self.settings.address)
        except Exception as e:  # noqa: BLE001 - a lost save is only a later miss
            if self._closing:
                self.metrics.add(dropped_saves=1)
            else:
                self.metrics.add(save_failures=1)
                if not self._save_failing:
                    self._save_failing = True
                    log.warning("kvcraft: storing a block in %s failed (%s: %s); later requests that compute "
                                "it save it again", self.settings.address, type(e).__name__, str(e)[:200])
        finally:
            self._release([save], stored=ok)
            with self._lock:
                self._pending -= 1
                self._idle.notify_all()

    def drain_saves(self, timeout_s: float) -> bool:
        """Wait until every queued save was sent (or failed); False if `timeout_s` passed first."""
        end = time.monotonic() + timeout_s
        with self._lock:
            while self._pending:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    # -- shutdown ----------------------------------------------------------------------------
    def shutdown(self, close_channel: Any) -> None:
        """Drain saves (bounded), stop loads, close the channel, join the threads."""
        t0 = time.monotonic()
        drained = self.drain_saves(self.settings.shutdown_drain_s)
        with self._lock:
            self._closing = True  # queued saves return at once, counted as dropped
            left = self._pending
            sources = list(self._sources)
        self._step_blend()  # the blends not started: reported failed
        for s in sources:
            s.cancel()
        close_channel()  # Stores still in flight end now; their errors are expected, not logged
        self._saver.shutdown(wait=True)
        self.loader.shutdown(wait=True)
        if self.holds is not None:
            self.holds.close()
            self.context.serving.close()
        self.shutdown_s = time.monotonic() - t0
        if drained:
            log.info("kvcraft: worker side shut down in %.2fs, every save sent", self.shutdown_s)
        else:
            log.info("kvcraft: worker side shut down in %.2fs; %d saves still queued or in flight after "
                     "shutdown_drain_s=%.1fs were dropped (dropped_saves)", self.shutdown_s, left,
                     self.settings.shutdown_drain_s)

