"""Reuse policies by name: the front a deployment configures them through.

Each policy is a plug-in of one file under `engine_adapter/policies/` (its options as a frozen
dataclass, its passes, its choice of rows per layer: `engine_adapter.selection`):

full        no reuse: every row computed at every layer (ground truth, and how new
            chunks get their variants + statistics).                     policies/exact.py
prefix      reuse only the leading run of chunks whose variant was computed behind
            exactly the chunks before it (a prefix cache: exact, no recompute).
naive       reuse every cached chunk, recompute nothing but fresh chunks and the question.
                                                                         policies/naive.py
cachecraft  the plan's per-chunk top-N token lists (Cache-Craft eq. 14), with
            focused-chunk early termination (Alg. 1, window w) when focus_window > 0.
                                                                         policies/cachecraft.py
cacheblend  HKVD with gradual filtering (CacheBlend §4.3): all reused tokens on layer 0,
            then the highest-KV-deviation r1 > r2 > ... > r of them. Named either by the
            paper's steady-state r (`ratio`) or by its whole `budget`.  policies/cacheblend.py
epic        each reused chunk's first tokens recomputed (the attention sink a chunk grows
            when computed apart; EPIC, Hu et al. 2024).                  policies/epic.py
ape         naive reuse, the question reading the reused chunks with APE's attention
            temperature and scale (Yang et al., ICLR 2025).              policies/ape.py
query       query-aware: a question pass with naive reuse measures which reused tokens the
            question reads (joined with the KV deviation of their stored layer-1 K/V); the
            second pass recomputes the most-read ones from layer 0, as many as the `budget`
            leaves, each with its chunk's head before it. The default.   policies/default.py

A budget left out is kvcraft.recompute.DEFAULT_BUDGET, the one the planner sizes by too.
`Policy(name, **options)` builds one of them once, from a name (configuration, CLI); an
option the named policy does not have is refused.
"""

from __future__ import annotations

import dataclasses

from engine_adapter.policies.ape import Ape
from engine_adapter.policies.base import ReusePolicy
from engine_adapter.policies.cacheblend import CacheBlend
from engine_adapter.policies.cachecraft import CacheCraft, FocusTracker, focused_chunks
from engine_adapter.policies.default import QueryAware
from engine_adapter.policies.epic import Epic
from engine_adapter.policies.exact import Full, Prefix, PrefixOf
from engine_adapter.policies.naive import Naive

# Every policy by its name, in the order users see them listed; POLICIES is the names.
_KINDS: dict[str, type[ReusePolicy]] = {
    kind.name: kind for kind in (Full, Prefix, Naive, CacheCraft, CacheBlend, Epic, Ape, QueryAware)}
POLICIES: tuple[str, ...] = tuple(_KINDS)


def Policy(name: str, **options: object) -> ReusePolicy:  # noqa: N802 - the name users construct by
    """The reuse policy `name` with `options` (its dataclass fields), chosen once."""
    kind = _KINDS.get(name)
    if kind is None:
        raise ValueError(f"unknown policy {name!r}; known: {POLICIES}")
    fields = set(kind.__dataclass_fields__)
    extra = sorted(set(options) - fields)
    if extra:
        raise ValueError(f"policy {name!r} has no option(s) {extra}; it takes {sorted(fields)}")
    return kind(**options)


DEFAULT_POLICY = "query"  # the policy a deployment runs unless it names another (docs/quality.md)


def parse_policy(spec: str) -> ReusePolicy:
    """A policy from its spec: a name, or `name:option=value,...` (numbers), e.g.
    `cacheblend:budget=0.15`. Raises ValueError naming the spec and what is wrong with it."""
    name, colon, rest = spec.strip().partition(":")
    if name not in _KINDS:
        raise ValueError(f"policy spec {spec!r}: unknown policy {name!r} (known: {', '.join(POLICIES)})")
    options: dict[str, int | float] = {}
    for item in rest.split(",") if colon else ():
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq or not key or not value:
            raise ValueError(f"policy spec {spec!r}: option {item.strip()!r} is not key=value")
        if key in options:
            raise ValueError(f"policy spec {spec!r}: option {key!r} given twice")
        options[key] = _number(value, spec, key)
    try:
        return Policy(name, **options)
    except (TypeError, ValueError) as e:
        raise ValueError(f"policy spec {spec!r}: {e}") from None


def with_budget(policy: ReusePolicy, budget: float, reuse: bool = True) -> ReusePolicy:
    """`policy` spending the fidelity controller's recompute budget (`Plan.recompute_budget`):
    1 is exact reuse only (`PrefixOf`: the leading chunks stored behind exactly the chunks
    before them; full prefill with `reuse` off, `Plan.no_reuse`), 0 leaves the policy as it is."""
    if budget <= 0:
        return policy
    if budget >= 1:
        return PrefixOf(layer_budget_s=policy.layer_budget_s, of=policy.name) if reuse else \
            Full(layer_budget_s=policy.layer_budget_s)
    return dataclasses.replace(policy, budget=budget)


def spent_budget(policy: ReusePolicy) -> float:
    """The recompute budget a request served by `policy` ran with: 1 where every row not
    exactly reused is computed (full prefill, the prefix cache), 0 for a policy without one (or
    CacheBlend named by its ratio)."""
    return 1.0 if isinstance(policy, (Full, Prefix)) else float(getattr(policy, "budget", None) or 0.0)


def _number(value: str, spec: str, key: str) -> int | float:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    raise ValueError(f"policy spec {spec!r}: option {key!r} needs a number, got {value!r}")


__all__ = ["Ape", "CacheBlend", "CacheCraft", "DEFAULT_POLICY", "Epic", "FocusTracker", "Full", "Naive", "POLICIES",
           "Policy", "Prefix", "PrefixOf", "QueryAware", "ReusePolicy", "focused_chunks", "parse_policy",
           "spent_budget", "with_budget"]
