"""Fidelity per model, measured on live traffic (docs/quality.md, "Fidelity on live traffic").

Engines compute full prefill for a sample of the requests they served from stored KV
(`engine_adapter.fidelity`) and send each comparison with their next Plan. `FidelityBook`
adds them up per (model id, policy): samples, top-1 agreements, the sums of KL and of
the computed share; it answers with the Wilson score interval on the agreement rate.

The tallies persist in the metadata database (`MetadataDB.put_fidelity`), unsynced and at
most once a second (`PERSIST_EVERY_S`) while samples arrive, and at close: a crash loses
at most the last second's samples, never a variant.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

log = logging.getLogger("kvcraft.fidelity")

Z95 = 1.959964  # the standard normal's 97.5% quantile: a two-sided 95% interval
PERSIST_EVERY_S = 1.0


def wilson(agree: int, samples: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval on a binomial rate (Wilson 1927; Brown, Cai & DasGupta 2001,
    eq. 4): centre (p + z²/2n) / (1 + z²/n), half width z sqrt(p(1-p)/n + z²/4n²) / (1 + z²/n).
    Unlike the normal approximation it stays inside [0, 1] and is not empty at 0 or n
    agreements. No samples: (0, 1), nothing known."""
    if samples <= 0:
        return 0.0, 1.0
    n, p = samples, agree / samples
    z2 = z * z
    d = 1 + z2 / n
    centre = (p + z2 / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / d
    # At 0 and n agreements the bound is exactly 0 or 1 (centre and half width cancel).
    lower = 0.0 if agree <= 0 else max(0.0, centre - half)
    upper = 1.0 if agree >= samples else min(1.0, centre + half)
    return lower, upper


@dataclass(frozen=True)
class Sample:
    """One shadow prefill's comparison (the proto's FidelitySample, checked at the edge)."""

    policy: str
    top1_agree: bool
    kl: float
    computed_share: float


@dataclass(frozen=True)
class Tally:
    """Every sample of one (model, policy) so far."""

    model_id: str
    policy: str
    samples: int = 0
    top1_agree: int = 0
    kl_sum: float = 0.0
    computed_share_sum: float = 0.0

    def add(self, s: Sample) -> "Tally":
        return Tally(self.model_id, self.policy, self.samples + 1, self.top1_agree + int(s.top1_agree),
                     self.kl_sum + s.kl, self.computed_share_sum + s.computed_share)

    @property
    def interval(self) -> tuple[float, float]:
        """Wilson 95% bounds on the top-1 agreement rate."""
        return wilson(self.top1_agree, self.samples)

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / self.samples if self.samples else 0.0

    @property
    def mean_computed_share(self) -> float:
        return self.computed_share_sum / self.samples if self.samples else 0.0


class TallyStore(Protocol):
    """Where tallies persist (`kvservice.metadata.MetadataDB`)."""

    def load_fidelity(self) -> list[Tally]: ...

    def put_fidelity(self, tallies: Iterable[Tally]) -> None: ...


class FidelityBook:
    """Tallies per (model id, policy); thread-safe (Plans arrive on several threads)."""

    def __init__(self, db: TallyStore | None = None, *, clock: Callable[[], float] = time.monotonic,
                 every_s: float = PERSIST_EVERY_S) -> None:
        self._db = db
        self._clock = clock
        self._every_s = every_s
        self._lock = threading.Lock()
        self._tallies: dict[tuple[str, str], Tally] = {}
        self._dirty: set[tuple[str, str]] = set()
        self._written = float("-inf")  # clock of the last write
        self._timer: threading.Timer | None = None
        self._closed = False
        self._failing = False
        if db is not None:
            for t in db.load_fidelity():
                self._tallies[(t.model_id, t.policy)] = t

    def observe(self, model_id: str, samples: Iterable[Sample]) -> None:
        """Count samples of `model_id`; persist now if the last write is a second old,
        else once it is (a timer), so that a quiet service still writes them soon."""
        with self._lock:
            for s in samples:
                key = (model_id, s.policy)
                self._tallies[key] = self._tallies.get(key, Tally(model_id, s.policy)).add(s)
                self._dirty.add(key)
            if not self._dirty or self._db is None or self._closed:
                return
            wait = self._written + self._every_s - self._clock()
            if wait <= 0:
                self._write_locked()
            elif self._timer is None:
                self._timer = threading.Timer(wait, self._persist_due)
                self._timer.daemon = True
                self._timer.start()

    def tallies(self) -> list[Tally]:
        """Every tally, by model id then policy."""
        with self._lock:
            return [self._tallies[k] for k in sorted(self._tallies)]

    def _persist_due(self) -> None:
        with self._lock:
            self._timer = None
            if not self._closed:
                self._write_locked()

    def _write_locked(self) -> None:
        """Write the changed tallies (unsynced): best effort, as access records are; a failed
        write keeps them dirty for the next one."""
        if not self._dirty or self._db is None:
            return
        try:
            self._db.put_fidelity([self._tallies[k] for k in self._dirty])
        except Exception as e:  # rocksdict raises plain Exception for RocksDB statuses
            if not self._failing:
                log.warning("fidelity tallies are not persisted (%s); they are kept in memory", e)
            self._failing = True
            return
        self._failing = False
        self._dirty.clear()
        self._written = self._clock()

    def close(self) -> None:
        """Write what changed since the last write; no write after this (the database closes next)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._write_locked()
            self._closed = True
