"""Loading controller (CacheBlend §5) and preload depth (Cache-Craft §3.4.2, eq. 16).

All times are per layer, in seconds: a layer is the unit the engine computes and
the unit the store transfers, and the two overlap (layer l+1 loads while layer l
computes).

  T_compute(n)  = c0 + c1 * n          n = tokens whose Q/K/V the layer computes
  T_load(t, B)  = l_t + B / bw_t       B = bytes of reused KV for one layer, tier t

Recompute ratio (CacheBlend §5, "Loading Controller"): the fraction r of reused
tokens to recompute such that recomputing costs what loading costs anyway,
  T_compute(base + r * reused) = T_load          -> r* = (T_compute^-1(T_load) - base) / reused
  r = clamp(max(r*, r_min), r_min, 1),  r_min = R_MIN (CacheBlend Fig. 16: 15%)
where `base` is what the layer computes regardless (new chunks, the question). With
base = 0 this is CacheBlend's rule; a ratio above the plan's own recompute share
is free quality, since it hides behind loading.

Preload depth (Cache-Craft eq. 16 / Alg. 2):
  Lp = max(1, (L - 1) * (1 - T_prefill / T_load) + 1), rounded up, at most L.

Estimators are linear and fitted online from timings the engine reports (a
decayed least-squares fit, so they follow drift); until they have data they use
the defaults below, from measurements made on a GPU host (Llama-3-8B on H100:
4 KiB of K+V per token per layer, pinned host->GPU ~55 GB/s, kvikio compat disk
~1.4 GB/s read, Python gRPC / Redis ~1 GB/s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

from kvcraft.recompute import DEFAULT_BUDGET

from .catalog import TIERS

# CacheBlend §5's minimum recompute ratio (15% there, from its Fig. 16): here the default
# recompute budget, so a plan never recomputes less than the adapter spends by default.
R_MIN = DEFAULT_BUDGET


@dataclass(frozen=True)
class TierProfile:
    """Load speed of a tier into GPU memory."""

    bandwidth_Bps: float
    latency_s: float


DEFAULT_TIER_PROFILES: dict[str, TierProfile] = {
    "gpu": TierProfile(bandwidth_Bps=2.0e12, latency_s=0.0),
    "host": TierProfile(bandwidth_Bps=55e9, latency_s=10e-6),
    "disk": TierProfile(bandwidth_Bps=1.4e9, latency_s=100e-6),
    "remote": TierProfile(bandwidth_Bps=1.0e9, latency_s=500e-6),
}


@dataclass(frozen=True)
class ModelProfile:
    """What the controller needs of a model (defaults: Llama-3-8B, fp16)."""

    num_layers: int = 32
    kv_bytes_per_token_layer: int = 2 * 8 * 128 * 2  # K+V, 8 kv heads, dim 128, fp16
    compute_s_fixed: float = 50e-6       # per layer, per forward
    compute_s_per_token: float = 1.25e-6  # per layer (~25k prompt tokens/s for 32 layers)


class LinearEstimator:
    """y = c0 + c1 * x, fitted by exponentially decayed least squares.

    Until `min_samples` observations with distinct x arrive (or if the fit comes out
    with a non-positive slope), it returns the default coefficients.
    """

    __slots__ = ("c0", "c1", "_d0", "_d1", "_decay", "_min", "_n", "_sx", "_sy", "_sxx", "_sxy")

    def __init__(self, c0: float, c1: float, decay: float = 0.98, min_samples: int = 3) -> None:
        self.c0, self.c1 = c0, c1
        self._d0, self._d1 = c0, c1
        self._decay, self._min = decay, min_samples
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def observe(self, x: float, y: float) -> None:
        # One NaN or inf would poison the sums, and every later estimate, for good.
        if not (math.isfinite(x) and math.isfinite(y)):
            return
        d = self._decay
        self._n = self._n * d + 1.0
        self._sx = self._sx * d + x
        self._sy = self._sy * d + y
        self._sxx = self._sxx * d + x * x
        self._sxy = self._sxy * d + x * y
        n = self._n
        var = self._sxx - self._sx * self._sx / n
        if n < self._min - 1e-9 or var <= 1e-12 * max(1.0, self._sxx):
            return
        c1 = (self._sxy - self._sx * self._sy / n) / var
        if not c1 > 0.0 or not math.isfinite(c1):
            self.c0, self.c1 = self._d0, self._d1
            return
        c0 = (self._sy - c1 * self._sx) / n
        if not math.isfinite(c0):
            self.c0, self.c1 = self._d0, self._d1
            return
        self.c0 = max(0.0, c0)
        self.c1 = c1

    def predict(self, x: float) -> float:
        return self.c0 + self.c1 * x

    def inverse(self, y: float) -> float:
        """The x with predict(x) == y (may be negative)."""
        return (y - self.c0) / self.c1


class LoadingDecision(NamedTuple):
    ratio: float               # recompute ratio r of reused tokens (CacheBlend §5)
    preload_depth: int         # Lp layers (Cache-Craft eq. 16)
    load_s_per_layer: float    # estimated T_load of the reused KV
    compute_s_per_layer: float  # estimated T_prefill of the planned computation


class LoadingController:
    """Per-model loading controller; not thread-safe (one per planner)."""

    def __init__(self, model: ModelProfile = ModelProfile(),
                 tiers: Mapping[str, TierProfile] | None = None,
                 r_min: float = R_MIN, names: Sequence[str] | None = None) -> None:
        """tiers: load profile per tier name (None: the defaults below); names: the
        tiers the store runs, fastest first (None: every profiled tier)."""
        if not 0.0 <= r_min <= 1.0:
            raise ValueError(f"r_min must be in [0, 1], got {r_min}")
        self.model = model
        self.r_min = r_min
        profiles = dict(DEFAULT_TIER_PROFILES if tiers is None else tiers)
        if names is None:
            names = [t for t in TIERS if t in profiles]
        missing = [t for t in names if t not in profiles]
        if missing:
            raise ValueError(f"no load profile for tier(s) {missing}; profiles exist for {sorted(profiles)}")
        self.tiers = list(names)
        # x = bytes per layer, y = seconds; slope = 1/bandwidth.
        self.load = {t: LinearEstimator(profiles[t].latency_s, 1.0 / profiles[t].bandwidth_Bps)
                     for t in self.tiers}
        # x = tokens computed in one layer, y = seconds.
        self.compute = LinearEstimator(model.compute_s_fixed, model.compute_s_per_token)

    # ------------------------------------------------------------ engine timings
    def observe_load(self, tier: str, nbytes_per_layer: float, seconds: float) -> None:
        est = self.load.get(tier)
        if est is None:
            raise ValueError(f"unknown tier {tier!r}; this controller knows {', '.join(self.tiers)}")
        est.observe(nbytes_per_layer, seconds)

    def observe_compute(self, tokens_per_layer: float, seconds: float) -> None:
        self.compute.observe(tokens_per_layer, seconds)

    # ------------------------------------------------------------ estimates
    def load_time(self, tokens_by_tier: Mapping[str, int]) -> float:
        """T_load per layer: tiers are read one after another, so times add."""
        bpt = self.model.kv_bytes_per_token_layer
        t = 0.0
        for tier, n in tokens_by_tier.items():
            if n:
                t += self.load[tier].predict(n * bpt)
        return t

    def compute_time(self, tokens: float) -> float:
        return self.compute.predict(tokens) if tokens > 0 else 0.0

    def recompute_ratio(self, reused_tokens: int, base_tokens: int, t_load: float) -> float:
        """CacheBlend §5: r with T_compute(base + r * reused) = T_load, at least r_min."""
        if reused_tokens <= 0:
            return self.r_min
        r = (self.compute.inverse(t_load) - base_tokens) / reused_tokens
        return min(1.0, max(self.r_min, r))

    def preload_depth(self, t_prefill: float, t_load: float) -> int:
        """Cache-Craft eq. 16: Lp = max(1, (L-1)(1 - T_prefill/T_load) + 1)."""
        L = self.model.num_layers
        if t_load <= 0.0:
            return 1
        lp = (L - 1) * (1.0 - t_prefill / t_load) + 1.0
        return min(L, max(1, math.ceil(lp - 1e-9)))

    def decide(self, tokens_by_tier: Mapping[str, int], fresh_chunk_tokens: int,
               question_tokens: int, recompute_tokens: int) -> LoadingDecision:
        """One plan's decision. tokens_by_tier: reused tokens per tier;
        fresh_chunk_tokens: chunk tokens computed from scratch; recompute_tokens: the
        plan's per-chunk recompute (Cache-Craft top-N)."""
        base_tokens = fresh_chunk_tokens + question_tokens
        # load_time, recompute_ratio, compute_time and preload_depth, inlined (once per Plan)
        bpt = self.model.kv_bytes_per_token_layer
        load = self.load
        reused = 0
        t_load = 0.0
        for tier, n in tokens_by_tier.items():
            if n:
                reused += n
                est = load[tier]
                t_load += est.c0 + est.c1 * (n * bpt)
        comp = self.compute
        if reused > 0:
            r = ((t_load - comp.c0) / comp.c1 - base_tokens) / reused
            ratio = 1.0 if r > 1.0 else r if r > self.r_min else self.r_min
        else:
            ratio = self.r_min
        computed = base_tokens + recompute_tokens
        t_prefill = comp.c0 + comp.c1 * computed if computed > 0 else 0.0
        return LoadingDecision(ratio, self.preload_depth(t_prefill, t_load), t_load, t_prefill)
