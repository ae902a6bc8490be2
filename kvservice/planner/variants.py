"""Variant choice and recompute tokens (Cache-Craft §3.1-3.3).

For chunk C_i placed behind the chunk sequence S_new (every chunk before it in the
new prompt, conversation history included), a stored variant computed behind S_old
(its `prefix_keys`) costs CFO (Cache Fix Overhead) of its tokens to fix:

  beta   = sum_{j in S_old ∩ S_new} inter(i,j) / sum_{j in S_old} inter(i,j)   (eq. 6)
  gamma  = D / (m (m-1) / 2), D = discordant pairs between the common chunks in
           S_old order and in S_new order, m = |S_old ∩ S_new|              (eq. 7)
  beta'  = beta * (1 - gamma)                                              (eq. 8)
  CCI    = sigmoid(a / b)                                                  (eq. 11)
  CFO    = alpha * CCI * (1 - beta')                                       (eq. 12)
  N      = ceil(CFO * |C_i|); recompute the top-N tokens by inter-attention (eq. 14)

The lowest-CFO variant is chosen (§3.3); no variant -> compute the chunk fresh.

Edge cases (decided here, documented in docs/planner.md):
  * empty S_old (chunk computed alone): beta = 1 if S_new is empty too (same
    context: none), else 0 — nothing the chunk attended to is present.
  * sum of inter(i,j) over S_old is 0, or stats lack per-prefix attention: beta is
    the unweighted share |S_old ∩ S_new| / |S_old|.
  * m < 2: gamma = 0 (no pair can be discordant).
  * b <= 0 (no intra-attention measured): CCI = 1, the conservative value; with
    a, b >= 0 eq. 11 otherwise gives CCI in [0.5, 1).
  * CFO is clamped to [0, 1]; a variant whose CFO is >= `max_cfo` is not worth
    loading and the chunk is computed fresh.
  * ties on CFO go to the faster tier, then the smaller variant id (determinism).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from kvcraft.recompute import DEFAULT_BUDGET

from .catalog import TIER_RANK, Variant

# CCI <= 1 and 1 - beta' <= 1, so CFO <= alpha: alpha caps the share of a chunk recomputed,
# and alpha = the default recompute budget names that budget (chunks stored behind another
# order come out at ~0.9 alpha, kvbench.engine.ttft); alpha = 1 recomputes ~90% of them, slower
# than a full prefill.
DEFAULT_ALPHA = DEFAULT_BUDGET


def beta(prefix_keys: Sequence[str], prefix_attention: Sequence[float],
         s_new: Mapping[str, int] | set[str]) -> float:
    """Prefix Overlap Score (Cache-Craft eq. 6). `s_new` holds the chunks before C_i
    in the new prompt (a set, or a key -> position map)."""
    if not prefix_keys:
        return 1.0 if not s_new else 0.0
    if len(prefix_attention) == len(prefix_keys):
        total = 0.0
        common = 0.0
        for k, w in zip(prefix_keys, prefix_attention):
            total += w
            if k in s_new:
                common += w
        if total > 0.0:
            return common / total
    n = sum(1 for k in prefix_keys if k in s_new)
    return n / len(prefix_keys)


def discordant_pairs(seq: Sequence[int]) -> int:
    """Pairs i < j with seq[i] > seq[j] (inversions). O(m^2): m is a handful of chunks."""
    d = 0
    for i in range(len(seq) - 1):
        x = seq[i]
        for y in seq[i + 1:]:
            if x > y:
                d += 1
    return d


def gamma(prefix_keys: Sequence[str], s_new_pos: Mapping[str, int]) -> float:
    """Order Penalty Score (Cache-Craft eq. 7): normalized Kendall tau distance
    between the common chunks in S_old order and in S_new order."""
    # A_old mapped to S_new positions; A_new is the same set sorted by position,
    # so the discordant pairs are the inversions of this sequence.
    pos = [s_new_pos[k] for k in prefix_keys if k in s_new_pos]
    m = len(pos)
    if m < 2:
        return 0.0
    return discordant_pairs(pos) / (m * (m - 1) / 2)


def adjusted_beta(b: float, g: float) -> float:
    """Cache-Craft eq. 8: beta' = beta * (1 - gamma)."""
    return b * (1.0 - g)


def cci(a: float, b: float) -> float:
    """Cache Context Impact (Cache-Craft eq. 11): sigmoid(a / b)."""
    if b <= 0.0:
        return 1.0
    return 1.0 / (1.0 + math.exp(-a / b))


def cfo(alpha: float, cci_value: float, beta_adj: float) -> float:
    """Cache-Craft eq. 12: CFO = alpha * CCI * (1 - beta'), clamped to [0, 1]."""
    v = alpha * cci_value * (1.0 - beta_adj)
    return 0.0 if v < 0.0 else 1.0 if v > 1.0 else v


def variant_cfo(info: Variant, s_new_pos: Mapping[str, int], alpha: float) -> float:
    """CFO of reusing `info` behind the chunks `s_new_pos` (key -> position).

    eq. 6-8 and 11-12 fused into one pass over the old prefix (this runs for every
    variant of every chunk of every request); equal to composing `beta`, `gamma`,
    `adjusted_beta`, `cci` and `cfo`, which the tests check.
    """
    st = info.stats
    keys = info.prefix_keys
    c = info.cci
    if c < 0.0:  # eq. 11 depends on the variant alone: computed once, kept on the record
        c = info.cci = cci(st.a, st.b)
    if not keys:
        return 0.0 if not s_new_pos else cfo(alpha, c, 0.0)
    pa = st.prefix_attention
    pos: list[int] = []
    get = s_new_pos.get
    total = common = 0.0
    if len(pa) == len(keys):
        for k, w in zip(keys, pa):
            total += w
            p = get(k)
            if p is not None:
                common += w
                pos.append(p)
    else:
        for k in keys:
            p = get(k)
            if p is not None:
                pos.append(p)
    if not pos:
        return cfo(alpha, c, 0.0)
    bt = common / total if total > 0.0 else len(pos) / len(keys)
    m = len(pos)
    g = discordant_pairs(pos) / (m * (m - 1) / 2) if m > 1 else 0.0
    return cfo(alpha, c, bt * (1.0 - g))


def recompute_count(cfo_value: float, token_count: int) -> int:
    """Cache-Craft §3.2.1: N = ceil(CFO * |C_i|), clamped to [0, |C_i|]."""
    # The epsilon keeps 0.1 * 10 = 1.0000000000000002 from becoming 2 tokens.
    n = math.ceil(cfo_value * token_count - 1e-9)
    return 0 if n < 0 else token_count if n > token_count else n


def recompute_tokens(info: Variant, cfo_value: float) -> tuple[int, ...]:
    """Cache-Craft eq. 14: the top-N tokens by stored inter-attention from prefix
    chunks, most contextualized first."""
    return tuple(info.recompute_order[: recompute_count(cfo_value, info.token_count)])


@dataclass(frozen=True, slots=True)
class VariantChoice:
    info: Variant
    cfo: float


def choose_variant(variants: Sequence[Variant], s_new_pos: Mapping[str, int],
                   alpha: float = DEFAULT_ALPHA, max_cfo: float = 1.0) -> VariantChoice | None:
    """The lowest-CFO variant (Cache-Craft §3.3), or None -> compute the chunk fresh."""
    best: Variant | None = None
    best_cfo = 2.0
    best_key = tie_key(None, s_new_pos)
    for v in variants:
        c = variant_cfo(v, s_new_pos, alpha)
        if c < best_cfo or (c == best_cfo and tie_key(v, s_new_pos) < best_key):
            best, best_cfo, best_key = v, c, tie_key(v, s_new_pos)
    if best is None or best_cfo >= max_cfo:
        return None
    return VariantChoice(best, best_cfo)


def fr_increment(cfo_value: float, floor: float = 0.01) -> float:
    """Cache-Craft §3.3: fr += 1/CFO on each reuse. A prefix-exact reuse has CFO 0;
    the floor caps its increment at 1/floor instead of infinity."""
    return 1.0 / max(cfo_value, floor)


def tie_key(v: Variant | None, s_new_pos: Mapping[str, int]) -> tuple[bool, int, str]:
    """Order of equally good variants: one computed behind exactly the chunks now before it
    first (its KV is full prefill's: what exact reuse serves; another of CFO 0 has the same
    chunks before it in another order or with others between), then faster tier, then smaller id."""
    if v is None:
        return (True, len(TIER_RANK) + 1, "")
    return (not is_exact(v, s_new_pos), TIER_RANK.get(v.tier, len(TIER_RANK)), v.variant_id)


def is_exact(v: Variant, s_new_pos: Mapping[str, int]) -> bool:
    """Was `v` computed behind exactly the chunks before it now (`s_new_pos`: key -> position,
    the prompt's chunks before it), in the same order?"""
    pk = v.prefix_keys
    return len(pk) == len(s_new_pos) and all(s_new_pos.get(k) == j for j, k in enumerate(pk))
