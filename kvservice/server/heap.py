"""The server's heap: freed memory goes back to the OS once the server is idle, and the
objects alive after start-up are kept out of the cyclic garbage collector's scans.

The server runs with glibc's mmap threshold at 32 MiB, its trim threshold at 64 MiB and
one arena (`kvservice.launcher.SERVER_ENV`, deploy/): layer-sized buffers (each FetchLayers
message, grpcio's copy of it, each received Store layer) are reused from the heap while
streams run. A 1 MiB threshold makes every one of them a fresh mmap, page faults and a
munmap on the event-loop thread, which holds FetchLayers far below grpcio's own stream.
Buffers freed by a burst of streams then stay in the heap, so once
no RPC has run for IDLE_TRIM_S, malloc_trim(0) hands the free pages back (a no-op where
the C library has no malloc_trim). It cannot shrink the free top of a second arena's
heap: hence one arena (after 8 stalled Stores of 8 MiB layers, +94 MiB stayed after the
trim with glibc's default arenas, +1 MiB with one).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import Callable

from kvcraft.heap import IDLE_TRIM_S, malloc_trim
from kvservice.server.status import InFlight

log = logging.getLogger("kvcraft.server")


REFREEZE_MIN_VARIANTS = 1000  # an index that grew by fewer since the last freeze is not worth a collection


class Freezer:
    """Keeps the index out of the cyclic garbage collector's scans. Python's full
    collection walks every tracked object while holding the GIL: at a million variants
    (about 3 tracked objects each) that is most of a second (docs/benchmarks.md), a stall
    of every RPC, and Python starts one each time the objects that survived collections
    grow by a quarter.

    `freeze` collects once, then moves every object alive now out of the collector's
    reach (`gc.freeze`); `kvcraft serve` calls it once the index is recovered.
    `IdleTrim` calls `freeze` again while no RPC runs, once the index has grown by a
    quarter (and by REFREEZE_MIN_VARIANTS) since: the collection then scans only what
    came since, and when nothing is in flight, so no Store's buffers or stream state,
    alive now and garbage in a cycle later, are frozen with it. Frozen objects are still
    freed by reference counting when the index drops them; only a reference cycle among
    them would stay. A server whose `freeze` was never called (tests, embedded use) is
    left alone."""

    def __init__(self, index_size: Callable[[], int]) -> None:
        self._index_size = index_size
        self.frozen_at: int | None = None  # index size at the last freeze

    def freeze(self) -> int:
        """Collect, freeze; returns how many objects are frozen in all."""
        gc.collect()
        gc.freeze()
        self.frozen_at = self._index_size()
        return gc.get_freeze_count()

    def due(self) -> bool:
        at = self.frozen_at
        return at is not None and self._index_size() >= at + max(REFREEZE_MIN_VARIANTS, at // 4)


class IdleTrim:
    """`InFlight.on_idle`: trim the heap `idle_s` after the last RPC ended, unless one
    is running by then (on the event loop; the trim itself on a worker thread), and
    freeze the grown index then when `freezer` says it is due (on the event loop: an RPC
    that arrives meanwhile waits for the collection instead of running beside it)."""

    def __init__(self, inflight: InFlight, freezer: Freezer, idle_s: float = IDLE_TRIM_S) -> None:
        self.inflight = inflight
        self.freezer = freezer
        self.idle_s = idle_s
        self._trim = malloc_trim()
        self._later: asyncio.TimerHandle | None = None

    def __call__(self) -> None:
        if self._later is not None:
            self._later.cancel()
        self._later = asyncio.get_running_loop().call_later(self.idle_s, self._run)

    def _run(self) -> None:
        self._later = None
        if self.inflight.active == 0:
            if self.freezer.due():
                frozen = self.freezer.freeze()
                log.info("the index grew to %d variants: %d objects now frozen out of the garbage collector's scans",
                         self.freezer.frozen_at, frozen)
            asyncio.get_running_loop().run_in_executor(None, self._trim)
