"""The blended requests the fidelity shadows give way to inside vLLM (`fidelity.Serving`).

A blended request is served from its blend's start until vLLM has handed out its first token:

  - built (`begin`): its blend runs, or ended and is not yet reported to vLLM;
  - reported by a `get_finished` (`reported`): vLLM runs its forward pass in the next step; held
    at most FORWARD_WAIT_S, for a request that was aborted or an engine that stopped stepping;
  - that pass ran (the next `reported`): the step's logits, sampling and output come after its
    `get_finished`, so it is held until the next step starts (`step_starts`), at most
    OUTPUT_WAIT_S where none follows (an engine with nothing more to run).

A shadow started earlier would take the cores and the GIL from that work and delay the
request's first token (docs/fidelity.md).
"""

from __future__ import annotations

import threading
from typing import Any

FORWARD_WAIT_S = 1.0
OUTPUT_WAIT_S = 0.05


class BlendHolds:
    """The served blended requests of one worker, over its context's `fidelity.Serving`."""

    def __init__(self, serving: Any) -> None:
        self.serving = serving
        self._lock = threading.Lock()
        self._built: set[str] = set()
        self._forward: set[str] = set()  # reported: in the forward pass after the last `reported`
        self._sampled: set[str] = set()  # that pass ran: their tokens go out before the next step

    def begin(self, req_id: str) -> None:
        """A blend starts."""
        self.serving.begin()
        with self._lock:
            self._built.add(req_id)

    def reported(self, done: set[str]) -> None:
        """The requests whose load or blend a `get_finished` reports: vLLM runs the blended ones
        in the next step, and ran those of the last call in the step this call ends."""
        with self._lock:
            ran, reported = self._forward, done & self._built
            self._forward = reported
            self._built -= done
            self._sampled |= ran
        for r in ran:
            self.serving.hold(r, OUTPUT_WAIT_S)
        for r in reported:
            self.serving.hold(r, FORWARD_WAIT_S)
            self.serving.end()  # (its blend's)

    def step_starts(self) -> None:
        """A step starts: the last one's tokens are out."""
        with self._lock:
            sampled, self._sampled = self._sampled, set()
        for r in sampled:
            self.serving.release(r)

    def close(self) -> None:
        """Every hold ends (the worker shuts down)."""
        with self._lock:
            built, held = self._built, self._forward | self._sampled
            self._built, self._forward, self._sampled = set(), set(), set()
        for r in held:
            self.serving.release(r)
        for _ in built:
            self.serving.end()


__all__ = ["BlendHolds", "FORWARD_WAIT_S", "OUTPUT_WAIT_S"]
