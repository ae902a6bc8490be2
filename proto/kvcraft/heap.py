"""Freed heap memory back to the OS once a process's kvcraft work is idle.

glibc keeps freed memory in the heap for the next allocations: under traffic that saves an
mmap, page faults and a munmap per buffer, but after a burst it stays resident. The service
trims its heap once no RPC has run for a second (`kvservice.server.heap`). Inside an
inference engine's process kvcraft's blends and fidelity shadows run on threads of their own,
each with its own glibc arena, so their peaks add up and stay (docs/vllm.md, "Memory of the
engine process"); `IdleTrim` trims there once no kvcraft work has run for a second. The first
request after an idle spell faults its pages in again (on the 2-core VM 16 ms more for a
115 MiB tensor); under steady traffic no trim runs.

`malloc_trim(0)` hands back the free pages inside every arena but the top of a thread's own
heap: glibc shrinks that only in a free() on the thread that owns it, and only while the top
is above the trim threshold, which grows with the largest block freed (to 64 MiB on 64-bit).
So a trim also runs on each thread of the pools that did kvcraft's work (`IdleTrim.watch`):
with the threshold lowered for the moment, each frees a block of RELEASE_BYTES, and glibc
cuts its heap's top to the page (`heap_trim` in glibc's arena.c).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

IDLE_TRIM_S = 1.0
M_TRIM_THRESHOLD = -1  # mallopt's parameter (glibc's malloc.h)
# The trim threshold while the threads release their tops, and after: the most glibc's dynamic
# threshold reaches on 64-bit (2 x DEFAULT_MMAP_THRESHOLD_MAX), so steady traffic trims as it would.
TRIM_LOW = 128 << 10
TRIM_AFTER = 64 << 20
# A free() of at least 64 KiB (FASTBIN_CONSOLIDATION_THRESHOLD) trims the thread's heap; below
# the least mmap threshold (128 KiB), so the block comes from that heap and not from mmap.
RELEASE_BYTES = 96 << 10
# How long a pool's threads wait for each other to release at once; a thread busy with new work
# by then releases nothing this time, and that work waited at most this long.
GATHER_S = 0.05


class Heap:
    """glibc's heap calls through ctypes; every call a no-op where the C library lacks them."""

    def __init__(self) -> None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
            self._trim, self._mallopt, self._malloc, self._free = libc.malloc_trim, libc.mallopt, libc.malloc, libc.free
        except (OSError, AttributeError):
            self._trim = None
            return
        self._trim.argtypes = [ctypes.c_size_t]
        self._mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        self._malloc.restype, self._malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        self._free.argtypes = [ctypes.c_void_p]

    def trim(self, pools: Sequence[ThreadPoolExecutor] = ()) -> None:
        """Every arena's free pages back to the OS, and the tops of the heaps of `pools`' threads."""
        if self._trim is None:
            return
        if pools:
            self._mallopt(M_TRIM_THRESHOLD, TRIM_LOW)
            try:
                for pool in pools:
                    _on_each_thread(pool, self.release_top)
            finally:
                self._mallopt(M_TRIM_THRESHOLD, TRIM_AFTER)
        self._trim(0)

    def release_top(self) -> None:
        """On the calling thread: a free() that lets glibc cut this thread's heap top (while the
        trim threshold is low)."""
        if self._trim is not None:
            self._free(self._malloc(RELEASE_BYTES))


def _on_each_thread(pool: ThreadPoolExecutor, fn: Callable[[], None]) -> None:
    """fn once on each thread `pool` has now, all at once (a barrier, so no thread takes two);
    none if the pool is shut down or its threads do not gather within GATHER_S."""
    n = len(pool._threads)  # noqa: SLF001 - the threads made so far (no public count)
    if not n:
        return
    gather = threading.Barrier(n)

    def each() -> None:
        try:
            gather.wait(GATHER_S)
        except threading.BrokenBarrierError:
            return
        fn()

    try:
        done = [pool.submit(each) for _ in range(n)]
    except RuntimeError:  # shut down
        gather.abort()
        return
    for f in done:
        f.result()


def malloc_trim() -> Callable[[], None]:
    """glibc's malloc_trim(0) (every arena's free pages handed back), or a no-op where the C
    library has none."""
    return Heap().trim


class IdleTrim:
    """Trims the heap `idle_s` after the last `touch` (work started or ended), when `busy()`
    says no work runs then (else once it has been idle that long), with the heap tops of the
    pools it `watch`es, and calls `on_trim`. One thread, started at the first touch and ended
    by `close`."""

    def __init__(self, busy: Callable[[], bool], idle_s: float = IDLE_TRIM_S,
                 on_trim: Callable[[], None] = lambda: None) -> None:
        self.busy, self.idle_s, self.on_trim = busy, idle_s, on_trim
        self._heap = Heap()
        self._pools: list[ThreadPoolExecutor] = []
        self._touched = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()

    def watch(self, pool: ThreadPoolExecutor) -> None:
        """The threads of `pool` do kvcraft's work: their heaps' tops are released at each trim."""
        with self._start:
            self._pools.append(pool)

    def touch(self) -> None:
        if self._thread is None:
            with self._start:
                if self._thread is None and not self._stop.is_set():
                    self._thread = threading.Thread(target=self._run, name="kvcraft-trim", daemon=True)
                    self._thread.start()
        self._touched.set()

    def _run(self) -> None:
        while True:
            self._touched.wait()
            while not self._stop.is_set() and (self._touched.is_set() or self.busy()):  # touched again, or busy
                self._touched.clear()
                self._stop.wait(self.idle_s)
            if self._stop.is_set():
                return
            with self._start:
                pools = list(self._pools)
            self._heap.trim(pools)
            self.on_trim()

    def close(self) -> None:
        self._stop.set()
        self._touched.set()
        if self._thread is not None:
            self._thread.join()


__all__ = ["IDLE_TRIM_S", "Heap", "IdleTrim", "malloc_trim"]
