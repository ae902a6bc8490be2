"""What the benchmarks share: the best of repeated timings, transfer result rows, and the
`--json` output of a bench's `main()`."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable


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


def add_json_argument(ap: argparse.ArgumentParser, help: str | None = None) -> None:
    """`--json PATH`: where `print_and_save` writes the bench's results."""
    ap.add_argument("--json", type=Path, help=help)


def print_and_save(out: Any, print_table: Callable[[Any], None], json_path: str | Path | None) -> int:
    """The tail of a bench's `main()`: its table printed, its results written to `json_path`
    (when given) as indented JSON; 0, the exit status."""
    print_table(out)
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=1))
    return 0
