"""kvcraft.heap: a trim once the work has been idle, never while it is busy; the heap tops of the
threads it watches released."""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys
import threading

import pytest

from kvcraft.heap import IdleTrim


def test_it_trims_once_after_the_last_touch_and_not_while_busy():
    polled, trimmed, released = [], threading.Event(), threading.Event()
    third_poll = threading.Event()

    def busy() -> bool:
        polled.append(1)
        if len(polled) == 3:
            third_poll.set()
        return not released.is_set()

    trims, second = [], threading.Event()

    def on_trim() -> None:
        trims.append(1)
        (second if len(trims) == 2 else trimmed).set()

    trim = IdleTrim(busy, idle_s=0.001, on_trim=on_trim)
    trim.touch()
    assert third_poll.wait(30)  # three idle spells found busy
    assert not trimmed.is_set()
    released.set()
    assert trimmed.wait(30)
    trim.touch()  # work again, then idle: one trim more
    assert second.wait(30)
    trim.close()
    assert len(trims) == 2 and not trim._thread.is_alive()


def test_closing_before_any_work_starts_no_thread():
    trim = IdleTrim(lambda: False)
    trim.close()
    trim.touch()
    assert trim._thread is None


# In a process of its own (the trim changes glibc's thresholds for the whole process): a pool
# thread leaves its heap's top free above a block it still holds (~16 MiB of it resident after malloc_trim).
_THREAD_TOP = r"""
import ctypes, ctypes.util, json
from concurrent.futures import ThreadPoolExecutor
from kvcraft.heap import Heap

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
def work():
    big = libc.malloc(20 << 20); ctypes.memset(big, 1, 20 << 20); libc.free(big)  # the thresholds grow
    blocks = [libc.malloc(100_000) for _ in range(300)]
    for b in blocks:
        ctypes.memset(b, 1, 100_000)
    libc.malloc(1000)  # held, above them
    for b in blocks:
        libc.free(b)
pool = ThreadPoolExecutor(2)
before = rss_mib()
pool.submit(work).result()
Heap().trim()
plain = rss_mib()
Heap().trim([pool])
print(json.dumps({"plain": plain - before, "released": rss_mib() - before}))
"""


def test_a_pool_threads_heap_top_is_released_where_malloc_trim_alone_keeps_it():
    if "libc.so" not in (ctypes.util.find_library("c") or ""):
        pytest.skip("glibc's heap only")
    out = subprocess.run([sys.executable, "-c", _THREAD_TOP], capture_output=True, text=True, timeout=120, check=True)
    mib = json.loads(out.stdout)
    assert mib["plain"] > 10, mib  # malloc_trim leaves the thread's top resident (the case this handles)
    assert mib["released"] < 4, mib
