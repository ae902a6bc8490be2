"""The scheduler side's service calls that must never block vLLM's scheduler: a request's
prefix lookup (MatchPrefix as gRPC futures) and the breaker that switches lookups and Plans
off after consecutive failures (docs/vllm.md "What the connector guarantees")."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import grpc

from engine_adapter.vllm.config import ConnectorSettings
from engine_adapter.vllm.metrics import ConnectorMetrics
from kvclient.errors import from_rpc_error

log = logging.getLogger("kvcraft.vllm")

MAX_IDS_PER_LOOKUP = 256  # the service's max_fetch_variants


class PrefixLookup:
    """One request's MatchPrefix, possibly over several RPCs of <= MAX_IDS_PER_LOOKUP ids."""

    def __init__(self, client: Any, vids: list[str], deadline: float,
                 on_done: Callable[[], None] | None = None) -> None:
        self._client = client
        self._vids = vids
        self.deadline = deadline
        self.matched = 0
        self._on_done = on_done  # called (on gRPC's thread) when an RPC of this lookup ends
        self._future = self._send()

    def _send(self) -> Any:
        part = self._vids[self.matched:self.matched + MAX_IDS_PER_LOOKUP]
        f = self._client.match_prefix_future(part, timeout=max(0.001, self.deadline - time.monotonic()))
        if self._on_done is not None:
            done = self._on_done
            f.add_done_callback(lambda _f: done())
        return f

    def pending(self) -> bool:
        """An RPC of this lookup is still unanswered."""
        return not self._future.done()

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


class Breaker:
    """`breaker_failures` consecutive timeouts or errors switch the service off for
    `retry_after_s`; the first answer after that switches it on again."""

    def __init__(self, settings: ConnectorSettings, metrics: ConnectorMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.failures = 0
        self._off_until = 0.0
        self._off_logged = False

    def is_off(self) -> bool:
        return time.monotonic() < self._off_until

    def answered(self) -> None:
        """A lookup answered: the failure count restarts (and the service is on again)."""
        self.failures = 0
        if self._off_logged:
            log.warning("kvcraft: service at %s answers prefix lookups again", self.settings.address)
            self._off_logged = False

    def failed(self, kind: str, why: str) -> None:
        self.metrics.add(**{"lookup_timeouts" if kind == "timeout" else "lookup_errors": 1})
        self.failures += 1
        if self.failures >= self.settings.breaker_failures and time.monotonic() >= self._off_until:
            self._off_until = time.monotonic() + self.settings.retry_after_s
            if not self._off_logged:
                what = "did not answer a prefix lookup in time" if kind == "timeout" else "failed a prefix lookup"
                log.warning("kvcraft: service at %s %s (%s: %s), %d times in a row; vLLM computes these "
                            "prompts itself, lookups off for %.1fs", self.settings.address, what, kind,
                            why[:200], self.failures, self.settings.retry_after_s)
                self._off_logged = True
