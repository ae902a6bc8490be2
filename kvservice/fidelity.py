"""Fidelity per model, measured on live traffic, and the budget that holds a target
(docs/fidelity.md).

Engines compute full prefill for the requests a Plan marks (`fidelity_sample`) when they
served them from stored KV (`engine_adapter.fidelity`), and send each comparison with
their next Plan. `FidelityBook` adds them up per (model id, policy, recompute budget):
samples, top-1 agreements, the sums of KL and of the computed share; it answers with the
Wilson score interval on the agreement rate.

The controller (`FidelityBook.decide`) gives an adaptive engine's Plans their recompute
budget, one of `LADDER`, per (model, policy). Each budget of the ladder is judged by its
own samples against the target t: *held* when the interval's lower bound is at or above t,
*short* when its upper bound is below t, *measuring* otherwise. A budget still measuring
after MAX_MEASURING_SAMPLES samples is judged by its observed agreement: *kept* at or above
t, short below it. A kept budget that Plans gave stays given (it is more likely above the
target than below, and no interval said it fell short); one only tried below is not given
(nothing showed it holds the target). The budget given is a function of the tallies alone:

    start at COLD_START; climb while the budget is short, or kept and never given (full
    prefill, 1, is exact and never short); then, if the least budget below it and above
    every such one is held, or was given and is not short, go there.

That least budget below is measured without serving it: while it is measuring, every Plan
asks for a sample and names it (`fidelity_below`), and the engine's shadow blends the
request again at that budget from the same stored KV and compares that blend with full
prefill too (a *shadow blend*: `engine_adapter.fidelity`). So a budget below the cold start
is served only once its own samples show it holds the target; the cheapest is tried first
(one verdict when it holds, as on a model where reuse costs little), and when it is shown
short the next one up is measured. A budget given once shown held stays given while later
samples leave it measuring (its interval straddling the target), and moves up only once it
is shown short. Plans mark every request while the budget given or the one below is
measuring, and `fidelity_sample` of them otherwise. A short budget stays short (no samples
reach it again): the budget settles after at most 2 x len(LADDER) moves and never
oscillates. A model on which no budget below 1 holds the target ends at budget 1, logged
once and shown in the metrics (`kvcraft_fidelity_budget` = 1).

Budget 1 is exact reuse only (state EXACT): the engine serves from storage the leading
chunks whose KV was computed behind exactly the chunks before them, as a prefix cache
would, and computes the rest (`engine_adapter.policy.with_budget`), so falling back costs
no more than a prefix cache. Exact reuse agrees with full prefill by construction; what it
trusts is the stored bytes. So its first MIN_VERDICT_SAMPLES requests served from storage
are measured too (then `fidelity_sample` of them), and if its samples are shown short the
stored KV is not what this engine computes (a broken writer, a wrong model id): Plans say
`no_reuse` from then on (state AT_FULL), and the engine computes full prefill.

Near ties (docs/fidelity.md, "Near ties"): the first tokens reuse loses are mostly those the
blend's own top token leads the runner-up by a fraction of a logit, and the blend's lead is
known with its first token. Each sample carries its blend's lead; a tally counts its samples by
lead (`LEAD_EDGES`), and the lost ones apart. The margin Plans give (`PlanResponse.near_tie`:
a blend leading by less is served by full prefill) is learned from the samples of the (model,
policy) at the budget given or above it (below 1: a budget below loses first tokens a served one
keeps): the largest edge, up to the one above the largest lead lost, under which at most
MAX_GATED of the samples' leads lie (never more than about a fifth of the blends sent to full
prefill) and at least MIN_LOST of them lost the first token (one in ten caught: where blends
lose first tokens at any lead, a gate costs compute and catches few). In the model's own logits,
from its own losses; no loss sampled, no margin. The budgets are judged on the blends as they
are (a near tie's sample is its blend's), so the margin only adds to the agreement the samples
show.

The tallies persist in the metadata database (`MetadataDB.put_fidelity`), unsynced and at
most once a second (`PERSIST_EVERY_S`) while samples arrive, and at close: a crash loses
at most the last second's samples, never a variant.
"""

from __future__ import annotations

import bisect
import logging
import math
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, Protocol

log = logging.getLogger("kvcraft.fidelity")

Z95 = 1.959964  # the standard normal's 97.5% quantile: a two-sided 95% interval
PERSIST_EVERY_S = 1.0

# The recompute budgets the controller gives (1: exact reuse only, no recompute budget), and where a model
# starts: above kvcraft.recompute.DEFAULT_BUDGET (15%), the budget the synthetic tasks were
# tuned at (docs/quality.md): conservative until its own samples say more. The rung at 20%:
# a budget whose agreement sits just above the target cannot be shown held within
# MAX_MEASURING_SAMPLES (the long synthetic stream's 15%, 0.961 against 0.95), and without
# a rung between it and 25% the budget given cost 1.13x the least budget meeting the target
# there; with it, 1.07x (docs/fidelity.md, "Streams as deployed").
LADDER = (0.05, 0.10, 0.15, 0.20, 0.25, 0.40, 0.60, 1.0)
COLD_START = 0.25
FULL = 1.0
# The default target: a request's first token agrees with full prefill's in at least 95% of
# requests (docs/quality.md says why), and once a budget is settled 3% of requests measured.
DEFAULT_TARGET = 0.95
DEFAULT_SAMPLE = 0.03
FIRST_SAMPLES = 8  # a non-adaptive (model, policy)'s first requests are all measured
# Samples a budget needs before a verdict. The interval is looked at after every sample, and
# repeated looks make a 95% interval err more often: simulated, a budget whose requests agree
# 97% against a 0.95 target is shown short at some point within 2000 samples 12% of the time
# judged from the first sample, 7% from the tenth; one agreeing 93% is shown held 0.6-0.8%.
# Fewer wrong "short"s cost compute, and a budget that fails is still left after 10 requests.
MIN_VERDICT_SAMPLES = 10
# A budget whose interval still straddles the target after this many samples is judged by
# its observed agreement (kept or short): a model whose agreement sits at the target would
# otherwise be measured on every request for good (the shadows' compute doubling the
# traffic's). Held within 400 samples needs an observed agreement of about 0.972 against a
# 0.95 target: a budget tried below the one given that sits between the two is not given
# (a step up, never fidelity), while the budget given stays given at or above the target.
MAX_MEASURING_SAMPLES = 400

# The bins of the samples' leads (the blend's top logit over the runner-up's); the most of the
# samples' leads a near-tie margin may lie above (what the gate may cost); the least share of
# the samples under it that lost their first token (what it must catch: one in ten of the
# requests it sends to full prefill). On MuSiQue at 10 passages the blends that lost the first
# token led by 0.02-0.67 logits, and 13-26% of all led by under 0.7 (docs/fidelity.md, "Near
# ties"); on the synthetic tasks' small models blends lose first tokens at any lead, and a
# margin there would cost compute and catch few.
LEAD_EDGES = (0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0)
MAX_GATED = 0.2
MIN_LOST = 0.1

MEASURING, HELD, SHORT, KEPT = "measuring", "held", "short", "kept"  # a budget's verdict
EXACT = "exact"  # a Choice's state at budget 1: exact reuse only (the prefix cache's)
AT_FULL = "full"  # at budget 1 where exact reuse is shown short as well: no stored KV served


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


def ladder_budget(budget: float) -> float:
    """The ladder's budget a sample's (float32) budget stands for, else the budget rounded
    to 4 places (a policy's own budget, off the ladder; 0: none)."""
    for b in LADDER:
        if abs(budget - b) < 1e-4:
            return b
    return round(budget, 4)


@dataclass(frozen=True)
class Sample:
    """One shadow prefill's comparison (the proto's FidelitySample, checked at the edge)."""

    policy: str
    top1_agree: bool
    kl: float
    computed_share: float
    budget: float = 0.0  # the recompute budget the request ran with; 0: its policy has none
    answer_tokens: int = 0  # answer tokens after the first compared under teacher forcing
    answer_agree: int = 0  # of those, predicted by full prefill as the served request chose
    shadow_blend: bool = False  # the shadow's blend at `budget` (Plan.fidelity_below), not the served request
    lead: float | None = None  # the compared blend's first token's lead, logits; None: not known


def lead_bin(lead: float) -> int:
    """The bin of a lead among LEAD_EDGES: i where LEAD_EDGES[i-1] <= lead < LEAD_EDGES[i]."""
    return bisect.bisect_right(LEAD_EDGES, lead)


def _count(bins: tuple[int, ...], i: int) -> tuple[int, ...]:
    out = list(bins) or [0] * (len(LEAD_EDGES) + 1)
    out[i] += 1
    return tuple(out)


@dataclass(frozen=True)
class Tally:
    """Every sample of one (model, policy, budget) so far."""

    model_id: str
    policy: str
    samples: int = 0
    top1_agree: int = 0
    kl_sum: float = 0.0
    computed_share_sum: float = 0.0
    budget: float = 0.0
    answer_tokens: int = 0
    answer_agree: int = 0
    shadow_blends: int = 0  # of the samples, the shadows' blends at this budget (never served)
    leads: tuple[int, ...] = ()  # the samples with a lead, per bin of LEAD_EDGES (empty: none yet)
    lost: tuple[int, ...] = ()  # of those, the ones whose first token was not full prefill's

    def add(self, s: Sample) -> "Tally":
        leads, lost = self.leads, self.lost
        if s.lead is not None:
            i = lead_bin(s.lead)
            leads, lost = _count(leads, i), (lost if s.top1_agree else _count(lost, i))
        return Tally(self.model_id, self.policy, self.samples + 1, self.top1_agree + int(s.top1_agree),
                     self.kl_sum + s.kl, self.computed_share_sum + s.computed_share, self.budget,
                     self.answer_tokens + s.answer_tokens, self.answer_agree + s.answer_agree,
                     self.shadow_blends + int(s.shadow_blend), leads, lost)

    def verdict(self, target: float) -> str:
        """HELD, SHORT, MEASURING, or at the cap KEPT, against a target agreement rate."""
        if self.samples < MIN_VERDICT_SAMPLES:
            return MEASURING
        lower, upper = self.interval
        if lower >= target:
            return HELD
        if upper < target:
            return SHORT
        if self.samples < MAX_MEASURING_SAMPLES:
            return MEASURING
        return KEPT if self.top1_agree >= target * self.samples else SHORT

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

    @property
    def answer_agreement(self) -> float | None:
        """The share of the answers' tokens after the first that full prefill, fed the served
        answer, predicts as served (teacher forcing); None: no answer compared. Tokens of one
        answer are not independent draws: no interval, and the controller reads only the
        first token's agreement."""
        return self.answer_agree / self.answer_tokens if self.answer_tokens else None


def near_tie_margin(tallies: Iterable[Tally]) -> float:
    """The near-tie margin the samples of `tallies` ask for (module docstring): the largest edge
    at most the one above the largest lead a sample lost its first token at, under which at most
    MAX_GATED of the samples' leads lie and at least MIN_LOST of those lost it; 0: none such."""
    leads = [0] * (len(LEAD_EDGES) + 1)
    lost = [0] * (len(LEAD_EDGES) + 1)
    for t in tallies:
        for i, (n, m) in enumerate(zip(t.leads, t.lost or (0,) * len(t.leads))):
            leads[i] += n
            lost[i] += m
    top = max((i for i, n in enumerate(lost) if n), default=-1)
    margin, under, under_lost = 0.0, 0, 0
    for i, edge in enumerate(LEAD_EDGES[:top + 1]):
        under, under_lost = under + leads[i], under_lost + lost[i]
        if under > MAX_GATED * sum(leads):
            break
        if under_lost and under_lost >= MIN_LOST * under:
            margin = edge
    return margin


class TallyStore(Protocol):
    """Where tallies persist (`kvservice.metadata.MetadataDB`)."""

    def load_fidelity(self) -> list[Tally]: ...

    def put_fidelity(self, tallies: Iterable[Tally]) -> None: ...


class Choice(NamedTuple):
    """The controller's answer for one (model, policy)."""

    model_id: str
    policy: str
    budget: float  # one of LADDER
    state: str  # MEASURING, HELD, KEPT; at budget 1 EXACT or AT_FULL
    below: float = 0.0  # the least budget below tried, measured by shadow blends; 0: none
    near_tie: float = 0.0  # the near-tie margin Plans give (`near_tie_margin`); 0: none


class Decision(NamedTuple):
    """A Plan's fidelity fields."""

    budget: float  # recompute_budget: one of LADDER; 0: the engine's own
    sample: bool  # fidelity_sample: measure this request
    below: float = 0.0  # fidelity_below: with sample, the budget its shadow also blends at; 0: none
    no_reuse: bool = False  # no_reuse: with budget 1, serve no stored KV (exact reuse shown short)
    near_tie: float = 0.0  # near_tie: with budget below 1, the margin under which a blend is served in full


class FidelityBook:
    """Tallies per (model id, policy, budget), and the controller that reads them;
    thread-safe (Plans arrive on several threads)."""

    def __init__(self, db: TallyStore | None = None, *, target: float = DEFAULT_TARGET,
                 sample: float = DEFAULT_SAMPLE, clock: Callable[[], float] = time.monotonic,
                 every_s: float = PERSIST_EVERY_S, seed: int | None = None) -> None:
        self._db = db
        self.target = target
        self.sample = sample
        self._rng = random.Random(seed)
        self._clock = clock
        self._every_s = every_s
        self._lock = threading.Lock()
        self._tallies: dict[tuple[str, str], dict[float, Tally]] = {}  # (model id, policy) -> budget -> tally
        self._choices: dict[tuple[str, str], Choice] = {}  # the last answer per adaptive (model, policy)
        self._dirty: set[tuple[str, str, float]] = set()  # (model id, policy, budget) written since
        self._written = float("-inf")  # clock of the last write
        self._timer: threading.Timer | None = None
        self._closed = False
        self._failing = False
        if db is not None:
            for t in db.load_fidelity():
                self._tallies.setdefault((t.model_id, t.policy), {})[t.budget] = t

    def observe(self, model_id: str, samples: Iterable[Sample]) -> None:
        """Count samples of `model_id`; persist now if the last write is a second old,
        else once it is (a timer), so that a quiet service still writes them soon."""
        with self._lock:
            for s in samples:
                budget = ladder_budget(s.budget)
                by_budget = self._tallies.setdefault((model_id, s.policy), {})
                by_budget[budget] = by_budget.get(budget, Tally(model_id, s.policy, budget=budget)).add(s)
                self._dirty.add((model_id, s.policy, budget))
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
        """Every tally, by model id, policy, then budget."""
        with self._lock:
            return [t for k in sorted(self._tallies) for _, t in sorted(self._tallies[k].items())]

    def decide(self, model_id: str, policy: str, adaptive: bool) -> Decision:
        """A Plan's fidelity fields for an engine of `model_id` serving by `policy`. Adaptive:
        the controller's budget, the one below while it is measured (module docstring); else
        budget 0 (the engine's own) and the (model, policy)'s first FIRST_SAMPLES requests
        measured, then `sample` of them. No target (0): no budget; requests measured as if
        not adaptive."""
        with self._lock:
            if not (adaptive and policy and self.target > 0):
                seen = sum(t.samples for t in self._tallies.get((model_id, policy), {}).values())
                return Decision(0.0, seen < FIRST_SAMPLES or self._rng.random() < self.sample)
            choice = self._choose_locked(model_id, policy)
            if choice.state == AT_FULL:
                return Decision(FULL, False, no_reuse=True)  # nothing served from stored KV to measure
            if choice.state == EXACT:
                exact = self._tallies.get((model_id, policy), {}).get(FULL)
                first = exact is None or exact.samples < MIN_VERDICT_SAMPLES
                return Decision(FULL, first or self._rng.random() < self.sample)
            if choice.state == MEASURING or choice.below:
                return Decision(choice.budget, True, choice.below, near_tie=choice.near_tie)
            return Decision(choice.budget, self._rng.random() < self.sample, near_tie=choice.near_tie)

    def choices(self) -> list[Choice]:
        """The controller's current budget of every adaptive (model, policy) that planned."""
        with self._lock:
            return [self._choices[k] for k in sorted(self._choices)]

    def _choose_locked(self, model_id: str, policy: str) -> Choice:
        by_budget = self._tallies.get((model_id, policy), {})

        def verdict(b: float) -> str:
            if b == FULL:
                return HELD  # exact: never left for a budget below (its samples judge its reuse)
            t = by_budget.get(b)
            return t.verdict(self.target) if t is not None else MEASURING

        def served(b: float) -> bool:  # Plans gave it: the cold start, or it was shown held then
            t = by_budget.get(b)
            return t is not None and t.samples > t.shadow_blends

        def left(b: float) -> bool:  # not given (again): short, or kept at the cap without being given
            v = verdict(b)
            return v == SHORT or (v == KEPT and not served(b))

        i = LADDER.index(COLD_START)
        while left(LADDER[i]):
            i += 1
        # The least budget below that is tried: above every one left (a budget below a short
        # one is not tried, as less recompute rarely agrees more). Given once shown held, and
        # kept while its later samples leave it measuring or kept: only a short verdict moves it up.
        least = max((j for j in range(i) if left(LADDER[j])), default=-1) + 1
        if least < i and (verdict(LADDER[least]) == HELD or served(LADDER[least])):
            i = least
        budget = LADDER[i]
        if budget == FULL:  # the reference itself for climbing; its exact reuse judged by its own samples
            exact = by_budget.get(FULL)
            state = AT_FULL if exact is not None and exact.verdict(self.target) == SHORT else EXACT
        else:
            state = verdict(budget)
        below = LADDER[least] if least < i and budget != FULL else 0.0
        margin = near_tie_margin(t for b, t in by_budget.items() if budget <= b < FULL)  # 0 at FULL
        choice = Choice(model_id, policy, budget, state, below, margin)
        last = self._choices.get((model_id, policy))
        if last != choice:
            self._choices[(model_id, policy)] = choice
            self._log_change(last, choice)
        return choice

    def _log_change(self, last: Choice | None, now: Choice) -> None:
        def seen(b: float) -> str:
            t = self._tallies.get((now.model_id, now.policy), {}).get(b)
            if t is None:
                return "no samples"
            lower, upper = t.interval
            return f"{t.top1_agree}/{t.samples} agreed, 95% interval [{lower:.3f}, {upper:.3f}]"

        who = f"model {now.model_id} policy {now.policy}"
        if now.state == AT_FULL:
            log.warning("kvcraft fidelity: %s: exact reuse disagrees with full prefill (%s; target %.3f): its stored "
                        "KV is not what this engine computes; its requests are served by full prefill from now on",
                        who, seen(FULL), self.target)
        elif now.budget == FULL and (last is None or last.budget != FULL):
            below = LADDER[-2]
            log.warning("kvcraft fidelity: %s cannot hold first-token agreement >= %.3f with reuse (budget %.2f: %s); "
                        "its requests are served by exact reuse only (the prefix cache's) from now on", who,
                        self.target, below, seen(below))
        elif last is None:
            log.info("kvcraft fidelity: %s starts at recompute budget %.2f (%s)", who, now.budget, now.state)
        elif last.budget != now.budget:
            why = min(last.budget, now.budget)  # down: the one below held; up: the one given fell short
            log.info("kvcraft fidelity: %s recompute budget %.2f -> %.2f (at %.2f: %s; target %.3f)", who,
                     last.budget, now.budget, why, seen(why), self.target)
        if now.near_tie != (last.near_tie if last else 0.0):
            if now.near_tie:
                log.info("kvcraft fidelity: %s serves blends whose first token leads by under %.2f logits by full "
                         "prefill (near ties; learned from the leads of the sampled blends that lost it)", who,
                         now.near_tie)
            else:
                log.info("kvcraft fidelity: %s serves no near tie by full prefill (the sampled blends' losses give "
                         "no margin within the gate's cost)", who)

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
            self._db.put_fidelity([self._tallies[(m, p)][b] for m, p, b in self._dirty])
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
