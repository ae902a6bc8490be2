"""How fast this machine is, measured at the start of a test run: a fixed CPU workload whose
time is printed beside the run's own (tests/conftest.py).

The 2-core VMs the suite runs on differ ~2x in speed from one to the next, so a suite time is
read against the same machine's time for a fixed amount of work: single-threaded fp32 matrix
products (what the engine tests spend most of their time in) and a pure-Python loop (what the
service and the test harness do). Measured before the run's workers start, on a quiet machine.
"""

from __future__ import annotations

import time

import torch

MATMULS = 1500  # of 256 x 256 fp32 matrices: ~0.5 s on the 2-core AMD EPYC VM
LOOP = 12_000_000  # iterations of a pure-Python loop: ~0.55 s there


def micro_benchmark() -> tuple[float, float]:
    """(seconds for the matrix products on one thread, seconds for the Python loop)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g)
        torch.mm(a, b)  # warm-up: the first call sets up the BLAS
        t0 = time.perf_counter()
        for _ in range(MATMULS):
            torch.mm(a, b)
        t1 = time.perf_counter()
    finally:
        torch.set_num_threads(threads)
    total = 0
    for i in range(LOOP):
        total += i & 7
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def line(times: tuple[float, float]) -> str:
    mm, loop = times
    return (f"machine speed (fixed CPU micro-benchmark, tests/machine_speed.py): {mm + loop:.2f} s "
            f"({MATMULS} single-thread 256x256 matmuls {mm:.2f} s, {LOOP:,}-step Python loop {loop:.2f} s)")
