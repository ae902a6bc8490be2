"""Segments that stopped answering: a node frozen (a stalled host, a long pause) or cut off
keeps its segment mounted until the master's client_ttl passes, and a read of an object in
it waits until the node answers again or the transfer engine gives up (seconds; a minute
seen). One silent segment must cost the objects in it, not every read or lookup.

A segment (named by its transfer endpoint, host:port) that did not answer a read in time is
silent: reads skip it at once. Every PROBE_INTERVAL_S it is probed two ways: the master is
asked whether it still holds the mark the segment's node keeps there (a call that does not
wait on the node: once the master dropped the segment, with what it held, nothing is left
there to wait for, and a node that comes back mounts it afresh), and the mark is read, one
read at a time (one that hangs waits on the node). Either answer makes it read from again.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

log = logging.getLogger("kvcraft.cluster")

PROBE_INTERVAL_S = 0.25
PROBES = 4  # silent segments probed at once
PROBE_READS = 8  # reads of marks in flight (one per silent segment; one that hangs holds its thread)


class SilentSegments:
    def __init__(self, marked: Callable[[str], bool | None], answers: Callable[[str], bool]) -> None:
        """marked(endpoint): whether the master holds the mark of the segment at `endpoint`
        (None: the master did not answer); answers(endpoint): whether a read of that mark
        returned it (may wait on the segment's node)."""
        self._marked = marked
        self._answers = answers
        self._silent: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._probes = ThreadPoolExecutor(PROBES, thread_name_prefix="kvcraft-probe")
        self._reads = ThreadPoolExecutor(PROBE_READS, thread_name_prefix="kvcraft-probe-read")

    def __contains__(self, endpoint: object) -> bool:
        return endpoint in self._silent

    def __bool__(self) -> bool:
        return bool(self._silent)

    def endpoints(self) -> tuple[str, ...]:
        """The silent segments now, in order."""
        with self._lock:
            return tuple(sorted(self._silent))

    def add(self, endpoint: str, why: str) -> None:
        """The segment at `endpoint` did not answer (`why`): skipped until a probe answers."""
        if not endpoint:
            return
        with self._lock:
            if endpoint in self._silent or self._stop.is_set():
                return
            self._silent.add(endpoint)
        log.warning("the cluster segment at %s stopped answering (%s): skipping it until it answers again",
                    endpoint, why)
        self._probes.submit(self._probe, endpoint)

    def _probe(self, endpoint: str) -> None:
        read: Future | None = None
        while not self._stop.wait(PROBE_INTERVAL_S):
            try:
                if self._marked(endpoint) is False:
                    return self._answered(endpoint, "the master dropped it and what it held")
                if read is None:
                    read = self._reads.submit(self._answers, endpoint)
                elif read.done():
                    answered, read = not read.exception() and read.result(), None
                    if answered:
                        return self._answered(endpoint, "it answers again")
            except Exception as e:  # a failed probe is a silent segment still, never a dead prober
                log.debug("probe of the segment at %s failed: %s", endpoint, e)

    def _answered(self, endpoint: str, why: str) -> None:
        with self._lock:
            self._silent.discard(endpoint)
        log.info("the cluster segment at %s is read from again: %s", endpoint, why)

    def close(self) -> None:
        self._stop.set()
        self._probes.shutdown(wait=False, cancel_futures=True)
        self._reads.shutdown(wait=False, cancel_futures=True)  # a read stuck on a frozen node is not waited for
