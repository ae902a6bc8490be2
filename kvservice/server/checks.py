"""Bounds of requests that the store and the planner do not know themselves, checked at
the edge before anything is registered (a lease, a timing in an estimator)."""

from __future__ import annotations

import math
from typing import Any

from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.config import Config
from kvservice.errors import InvalidArgument, ResourceExhausted
from kvservice.planner.catalog import TIERS


def check_ttl(name: str, ttl_s: float, cfg: Config) -> None:
    """A lease ttl must be finite and within max_lease_ttl_s, checked before any lease
    exists (a NaN ttl would never expire and hold its variants forever)."""
    if not 0 <= ttl_s <= cfg.max_lease_ttl_s:
        raise InvalidArgument(f"{name} is {ttl_s}; expected 0 (lease_timeout_s) .. max_lease_ttl_s "
                              f"({cfg.max_lease_ttl_s:g}) seconds")


# Bounds on engine-reported timings: far beyond any real layer, far below overflow of
# the estimators' sums of squares.
_MAX_TIMING = {"bytes_per_layer": float(1 << 50), "tokens_per_layer": float(1 << 32), "seconds": 3600.0}


def _check_timing(where: str, t: Any, fields: tuple[str, ...]) -> None:
    for f in fields:
        v = getattr(t, f)
        if not (math.isfinite(v) and 0 <= v <= _MAX_TIMING[f]):
            raise InvalidArgument(f"{where}.{f} is {v}; expected a finite number in [0, {_MAX_TIMING[f]:g}]")


def check_plan_request(req: pb.PlanRequest, cfg: Config) -> None:
    """Bounds of a Plan request the planner itself does not know (limits, ttl, timings)."""
    check_ttl("lease_ttl_s", req.lease_ttl_s, cfg)
    if len(req.chunks) > cfg.max_fetch_variants:
        raise InvalidArgument(f"{len(req.chunks)} chunks; at most max_fetch_variants={cfg.max_fetch_variants}")
    for i, c in enumerate(req.chunks):
        n = len(c.token_ids) or c.token_count
        if n > cfg.max_chunk_tokens:
            raise ResourceExhausted(f"chunks[{i}] has {n} tokens; max_chunk_tokens is {cfg.max_chunk_tokens}")
    for i, t in enumerate(req.timings.loads):
        if t.tier not in TIERS:
            raise InvalidArgument(f"timings.loads[{i}].tier is {t.tier[:40]!r}; expected one of {', '.join(TIERS)}")
        _check_timing(f"timings.loads[{i}]", t, ("bytes_per_layer", "seconds"))
    for i, t in enumerate(req.timings.computes):
        _check_timing(f"timings.computes[{i}]", t, ("tokens_per_layer", "seconds"))
