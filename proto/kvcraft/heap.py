"""Freed heap memory back to the OS once a process's kvcraft work is idle.

glibc keeps freed memory in the heap for the next allocations: under traffic that saves an
mmap, page faults and a munmap per buffer, but after a burst it stays resident. The service
trims its heap once no RPC has run for a second (`kvservice.server.heap`). Inside an
inference engine's process kvcraft's blends and fidelity shadows run on threads of their own,
each with its own glibc arena, so their peaks add up and stay (docs/vllm.md, "Memory of the
engine process"); `IdleTrim` trims there once no kvcraft work has run for a second. The first
request after an idle spell faults its pages in again (on the 2-core VM 16 ms more for a
115 MiB tensor); under steady traffic no trim runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import Callable

IDLE_TRIM_S = 1.0


def malloc_trim() -> Callable[[], None]:
    """glibc's malloc_trim(0) (every arena's free pages handed back), or a no-op where the C
    library has none."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or None).malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0) and None


class IdleTrim:
    """Trims the heap `idle_s` after the last `touch` (work started or ended), when `busy()`
    says no work runs then (else once it has been idle that long), and calls `on_trim`. One
    thread, started at the first touch and ended by `close`."""

    def __init__(self, busy: Callable[[], bool], idle_s: float = IDLE_TRIM_S,
                 on_trim: Callable[[], None] = lambda: None) -> None:
        self.busy, self.idle_s, self.on_trim = busy, idle_s, on_trim
        self._trim = malloc_trim()
        self._touched = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()

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
            self._trim()
            self.on_trim()

    def close(self) -> None:
        self._stop.set()
        self._touched.set()
        if self._thread is not None:
            self._thread.join()


__all__ = ["IDLE_TRIM_S", "IdleTrim", "malloc_trim"]
