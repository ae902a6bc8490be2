"""The connector's counters: one object per connector instance (per role), thread-safe.

Where a user reads them (docs/vllm.md): vLLM's own Prometheus counters
`vllm:external_prefix_cache_queries` / `vllm:external_prefix_cache_hits` (tokens the
scheduler side promised), vLLM's periodic "KV Transfer metrics" log line (both roles'
increments, handed to vLLM as `KVCraftStats` every step), and, with vLLM in the caller's
process, `engine_adapter.vllm.connector_metrics(llm)`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

SCHEDULER_COUNTERS = (
    "lookups",                 # MatchPrefix answers asked for (one per request, not per attempt)
    "lookup_timeouts",         # no answer within lookup_timeout_s
    "lookup_errors",           # the service answered with an error / could not be reached
    "lookups_skipped",         # requests not looked up while lookups were switched off
    "promised_tokens",         # tokens vLLM accepted from kvcraft's prefix blocks (num_external_tokens)
    "promised_blocks",
    "partial_accepts",         # vLLM accepted fewer tokens than offered (the covering blocks are loaded)
    "resumed_requests",        # asked about again after a preemption (answered without a new lookup)
    "planned_saves",           # blocks handed to the worker side for Store
    "blend_plans",             # Plan RPCs sent for requests with chunk boundaries
    "blend_timing_reports",    # of those, Plans that carried the finished blends' load/compute timings
    "blend_plan_timeouts",     # no Plan within plan_timeout_s (vLLM computed the request alone)
    "blend_plan_errors",
    "blend_declined",          # the Plan did not fit the prompt (order changed / chunks dropped)
    "blend_bad_params",        # kv_transfer_params['kvcraft'] refused (logged)
    "blend_requests",          # admissions whose context kvcraft builds
    "blend_claimed_tokens",    # tokens vLLM accepted from those
    "blend_namespace_misses",  # blends that reused nothing while their chunks are stored under another
                               # dtype (engine_adapter.namespace: logged once, with the fix)
)
WORKER_COUNTERS = (
    "loaded_tokens",           # tokens whose every layer was written into vLLM's KV
    "loaded_shared_blocks",    # blocks of those loads read from the service's shared memory (same host)
    "loaded_streamed_blocks",  # blocks of those loads read over a FetchLayers stream
    "failed_load_tokens",      # tokens of loads reported failed (vLLM recomputed them)
    "failed_load_blocks",
    "saved_blocks",            # Store confirmed by the service
    "save_failures",           # Store failed (the block is planned again by a later request)
    "dropped_saves",           # not sent: queue full, or shutdown reached its drain bound
    "duplicate_saves",         # already stored or in flight: not copied again
    "incomplete_save_steps",   # a step whose layers did not all reach save_kv_layer: not saved
    "blend_built_tokens",      # claimed tokens whose blended KV was written into vLLM's cache
    "blend_row_layers",        # rows kvcraft computed for them, summed over layers (question rows included)
    "blend_failed",            # blends reported failed (vLLM recomputed the request)
    "blend_failed_tokens",
    "blend_s",                 # seconds spent building contexts
    "answered_last_tokens",    # blended requests' last prompt tokens answered by the blend (vLLM ran no layer)
    "last_token_misses",       # of those the scheduler side named, ones vLLM computed after all (logged)
    "heap_trims",              # freed heap handed back to the OS once blends and shadows were idle (kvcraft.heap)
)


@dataclass
class ConnectorMetrics:
    """Counters of one connector instance; `snapshot()` for a consistent copy."""

    values: dict[str, float] = field(default_factory=dict)
    scheduler_step_max_s: float = 0.0   # longest time the scheduler spent in kvcraft in one step
    scheduler_steps: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **inc: float) -> None:
        with self._lock:
            for k, v in inc.items():
                self.values[k] = self.values.get(k, 0) + v

    def step(self, seconds: float) -> None:
        with self._lock:
            self.scheduler_steps += 1
            self.scheduler_step_max_s = max(self.scheduler_step_max_s, seconds)

    def get(self, name: str) -> float:
        with self._lock:
            return self.values.get(name, 0)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {k: 0 for k in SCHEDULER_COUNTERS + WORKER_COUNTERS}
            out.update(self.values)
            out["scheduler_step_max_s"] = self.scheduler_step_max_s
            out["scheduler_steps"] = self.scheduler_steps
            return out


@dataclass
class KVCraftStats(KVConnectorStats):
    """The worker side's counter increments since the last step, as vLLM carries them to
    the scheduler process and its stat loggers ("KV Transfer metrics" log line)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVCraftStats":
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        """vLLM's scheduler calls this and skips stats that are empty (the base raises)."""
        return not any(self.data.values())
