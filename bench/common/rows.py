"""Timing rows the transfer benchmarks share: the best of repeated timings, a measured time
kept to significant digits, a transfer's row (bytes, seconds, GB/s)."""

from __future__ import annotations

import time
from typing import Callable


def best_time(fn: Callable[[], object], repeat: int) -> float:
    """The shortest of `repeat` timed calls of `fn`, in seconds."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def significant(x: float, digits: int = 4) -> float:
    """`x` kept to `digits` significant digits: a measured time stays positive however
    short it was (fixed decimals turn a 40 µs copy into 0.0)."""
    return float(f"{x:.{digits}g}")


def transfer_row(path: str, nbytes: int, seconds: float) -> dict:
    """One row of a transfer benchmark: the bytes moved, the seconds they took and the GB/s."""
    return {"path": path, "bytes": nbytes, "seconds": significant(seconds),
            "GB_per_s": significant(nbytes / seconds / 1e9, 3)}
