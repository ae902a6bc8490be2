"""What `kvcraft selftest` reports and how it measures (kvcli.selftest runs the checks):
each check PASS, FAIL or SKIP with its detail, each rate into GPU memory beside the limit
measured in the same run, the printed report, and the median-rate timer."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np


@dataclass
class Result:
    check: str
    status: str  # PASS, FAIL or SKIP
    detail: str = ""


@dataclass
class Rate:
    path: str  # what moved where
    gbps: float
    limit: str  # what the same-run limit is
    limit_gbps: float | None

    @property
    def fraction(self) -> float | None:
        return self.gbps / self.limit_gbps if self.limit_gbps else None


@dataclass
class Report:
    environment: dict[str, Any] = field(default_factory=dict)
    results: list[Result] = field(default_factory=list)
    rates: list[Rate] = field(default_factory=list)
    kernels: list[dict] = field(default_factory=list)

    def add(self, check: str, fn: Callable[[], str | None]) -> None:
        """Run a check: returns a detail (PASS), raises Skip (SKIP) or anything (FAIL)."""
        try:
            self.results.append(Result(check, "PASS", fn() or ""))
        except Skip as s:
            self.results.append(Result(check, "SKIP", str(s)))
        except Exception as e:  # noqa: BLE001 - a self-test reports every failure and goes on
            self.results.append(Result(check, "FAIL", f"{type(e).__name__}: {e}"))

    @property
    def failed(self) -> bool:
        return any(r.status == "FAIL" for r in self.results)


class Skip(Exception):
    """This check cannot run on this host; the message says why."""


def median_gbps(nbytes: int, run: Callable[[], None], repeat: int,
                 before: Callable[[], None] = lambda: None) -> float:
    """Median rate of `run` moving `nbytes`; `before` runs untimed ahead of each run."""
    before()
    run()  # warm-up: first-touch, context creation, page cache effects on the destination
    times = []
    for _ in range(repeat):
        before()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def payload(nbytes: int) -> bytes:
    return np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def torch_cuda() -> Any:
    try:
        import torch
    except ImportError as e:
        raise Skip(f"torch not importable: {e}") from None
    if not torch.cuda.is_available():
        raise Skip("torch sees no CUDA device")
    return torch


def drop_cache(path: Path) -> None:
    """Ask the kernel to forget the file's cached pages, so a read goes to the drive."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def print_report(report: Report) -> None:
    print("kvcraft selftest")
    for k, v in report.environment.items():
        print(f"  {k:<14} {v}")
    print()
    width = max(len(r.check) for r in report.results)
    for r in report.results:
        print(f"  {r.status:<5} {r.check:<{width}}  {r.detail}")
    if report.rates:
        print()
        print(f"  {'into GPU memory':<40} {'GB/s':>8}   {'same-run limit':<30} {'GB/s':>8} {'of limit':>9}")
        for rate in report.rates:
            lim = f"{rate.limit_gbps:8.2f}" if rate.limit_gbps else f"{'n/a':>8}"
            frac = f"{100 * rate.fraction:8.0f}%" if rate.fraction else f"{'':>9}"
            print(f"  {rate.path:<40} {rate.gbps:8.2f}   {rate.limit:<30} {lim} {frac}")
    skipped = [r for r in report.results if r.status == "SKIP"]
    if skipped:
        print(f"\n  {len(skipped)} check(s) skipped on this host (see SKIP lines); "
              "nothing was measured for them.")
