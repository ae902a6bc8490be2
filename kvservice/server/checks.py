"""Bounds of requests that the store and the planner do not know themselves, checked at
the edge before anything is registered (a lease, a timing in an estimator)."""

from __future__ import annotations

import math
from typing import Any, Sequence

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


# Fidelity samples (kvservice.fidelity): how many one Plan may carry, how long a policy's
# name may be (a Prometheus label and part of a metadata key), the largest KL taken (a
# float64 softmax's KL stays below ~750 nats; the bound keeps the tallies' sums finite).
MAX_FIDELITY_SAMPLES = 64
MAX_POLICY_CHARS = 64
MAX_KL = 1e4
# Row-layers computed over the prompt's: above 1 where a two-pass policy, or layers the
# stream did not deliver in time, compute rows twice.
MAX_COMPUTED_SHARE = 4.0
# Answer tokens one sample compares under teacher forcing (engines compare at most 16).
MAX_ANSWER_TOKENS = 4096


def _check_policy_name(where: str, name: str) -> None:
    if not (0 < len(name) <= MAX_POLICY_CHARS and name.isprintable()):
        raise InvalidArgument(f"{where} is {name[:40]!r}; expected a policy name of 1..{MAX_POLICY_CHARS} "
                              f"printable characters")


def check_fidelity(samples: Sequence[Any]) -> None:
    """The fidelity samples of a Plan's timings (`pb.FidelitySample`)."""
    if len(samples) > MAX_FIDELITY_SAMPLES:
        raise InvalidArgument(f"timings.fidelity has {len(samples)} samples; at most {MAX_FIDELITY_SAMPLES} a Plan")
    for i, s in enumerate(samples):
        where = f"timings.fidelity[{i}]"
        _check_policy_name(f"{where}.policy", s.policy)
        if not (math.isfinite(s.kl) and 0 <= s.kl <= MAX_KL):
            raise InvalidArgument(f"{where}.kl is {s.kl}; expected a finite number in [0, {MAX_KL:g}]")
        if not 0 <= s.computed_share <= MAX_COMPUTED_SHARE:  # NaN fails too
            raise InvalidArgument(f"{where}.computed_share is {s.computed_share}; expected a number in "
                                  f"[0, {MAX_COMPUTED_SHARE:g}]")
        if not 0 <= s.budget <= 1:
            raise InvalidArgument(f"{where}.budget is {s.budget}; expected a number in [0, 1]")
        if s.HasField("lead") and not (math.isfinite(s.lead) and s.lead >= 0):
            raise InvalidArgument(f"{where}.lead is {s.lead}; expected a finite number >= 0 (logits)")
        if s.answer_tokens > MAX_ANSWER_TOKENS:
            raise InvalidArgument(f"{where}.answer_tokens is {s.answer_tokens}; at most {MAX_ANSWER_TOKENS}")
        if s.answer_agree > s.answer_tokens:
            raise InvalidArgument(f"{where}.answer_agree is {s.answer_agree}, more than its answer_tokens "
                                  f"({s.answer_tokens})")


def check_policy(req: Any) -> None:
    """A Plan request's policy name, and `adaptive` only with one."""
    if req.policy:
        _check_policy_name("policy", req.policy)
    if req.adaptive and not req.policy:
        raise InvalidArgument("adaptive needs policy: the recompute budget is held per model and policy")


def check_plan_request(req: pb.PlanRequest, cfg: Config) -> None:
    """Bounds of a Plan request the planner itself does not know (limits, ttl, timings,
    fidelity samples)."""
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
    check_fidelity(req.timings.fidelity)
    check_policy(req)
