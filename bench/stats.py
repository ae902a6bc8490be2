"""Percentiles, defined once for every benchmark that reports them.

p50 and p99 are nearest-rank percentiles: the q-th percentile of n samples is the smallest
sample with at least q x n samples at or below it (`sorted[ceil(q n) - 1]`), always a value
that was measured. So the p99 of fewer than 100 samples is their maximum, and every summary
carries its sample count `n`: a reader sees when a "p99" is the slowest of 6.
"""

from __future__ import annotations

import math
from typing import Iterable


def percentile(samples: Iterable[float], q: float) -> float:
    """Nearest-rank q-th percentile (0 < q <= 1); NaN without samples."""
    if not 0.0 < q <= 1.0:
        raise ValueError(f"q must be in (0, 1], got {q}")
    xs = sorted(samples)
    if not xs:
        return float("nan")
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


def summary(samples: Iterable[float], prefix: str = "", unit: str = "", scale: float = 1.0,
            digits: int | None = None) -> dict[str, float]:
    """{"<prefix>n", "<prefix>p50<unit>", "<prefix>p99<unit>", "<prefix>mean<unit>"} of `samples`
    times `scale` (seconds to ms: scale=1e3, unit="_ms"), rounded to `digits` decimals if given."""
    xs = [x * scale for x in samples]
    r = (lambda x: round(x, digits)) if digits is not None else (lambda x: x)  # noqa: E731
    mean = sum(xs) / len(xs) if xs else float("nan")
    return {f"{prefix}n": len(xs), f"{prefix}p50{unit}": r(percentile(xs, 0.5)),
            f"{prefix}p99{unit}": r(percentile(xs, 0.99)), f"{prefix}mean{unit}": r(mean)}
