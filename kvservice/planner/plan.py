"""The planner: one object that turns a request's retrieved chunks into a Plan.

`Planner.plan` runs these steps, in this order (docs/planner.md, "Algorithms as built"):
  1. chunk table              `_chunk_table`: check the request, token count per key
  2. conversation dedup       `_dedup` (CRAFT §4.3): drop chunks sent in earlier turns
                              or earlier in this request
  3. CA-Table count           every retrieved chunk, once (CRAFT §4.2 "Table Update";
                              before the reorder: +1 to every chunk keeps their order)
  4. reorder, first turn only `_reorder` (CRAFT §4.2): a CP-Tree path the chunks already
                              form first, the rest by a stable sort on CA-Table count
  5. CP-Tree prefix           first turn only (CRAFT §4.1): prefix-exact KV, no recompute
  6. variant per chunk        `_chunk_plans` (Cache-Craft §3.1-3.3): the lowest-CFO
                              variant of each remaining chunk, else fresh; recompute its
                              top ceil(CFO |C|) tokens (eq. 14), or, when the chunk has
                              learned scores, see step 9
  7. state update             `_remember`: CP-Tree promotion / extension (CRAFT §4.2),
                              the ChunkMap records the chunks sent (§4.3)
  8. loading controller       CacheBlend §5 ratio, Cache-Craft eq. 16 preload depth Lp
  9. learned budget           `_spend_learned`: the controller's ratio spent prompt-wide
                              on the learned scores (`kvcraft.recompute.allocate`), then
                              the controller asked again with that recompute
The lease on the reused variants is not the planner's: `kvservice.planning.PlanningService`
takes it after `plan` returns.

The CP-Tree applies only to a first turn: a later turn's chunks follow the
conversation's history in the prompt, so they are never at a chunk-prefix.

Not thread-safe: one call at a time under `kvservice.planning.PlanningService`'s lock
(one planner per process; the server calls it on its event loop, or from a worker thread
when a cluster is configured).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple, Sequence

from kvcraft.recompute import allocate

from .ca_table import DEFAULT_WINDOW, CATable
from .catalog import Variant, VariantCatalog
from .controller import R_MIN, LoadingController, ModelProfile, TierProfile
from .conversation import DEFAULT_MAX_CHUNKS, DEFAULT_MAX_CONVERSATIONS, DEFAULT_TTL_S, ChunkMap, dedup
from .cp_tree import DEFAULT_PROMOTION_THRESHOLD, CPNode, CPTree
from .reorder import reorder_by_count
from .variants import DEFAULT_ALPHA, cci, recompute_count, tie_key, variant_cfo

MAX_MODELS = 256  # loading controllers kept (one per model planned)

# ChunkPlan.source
PREFIX = "prefix"    # CP-Tree prefix: the variant is exact, nothing to recompute
VARIANT = "variant"  # Cache-Craft reuse: load the variant, recompute `recompute`
FRESH = "fresh"      # no usable variant: compute the whole chunk


class PlanError(ValueError):
    """A Plan request that cannot be planned (maps to INVALID_ARGUMENT)."""


class ChunkRef(NamedTuple):
    """One retrieved chunk as the request names it."""

    key: str
    token_count: int


@dataclass(frozen=True)
class PlannerConfig:
    """Planner settings; validated once, at construction.

    The four switches turn the paper mechanisms on and off (the benchmark uses them to
    replay one trace under several policies); production keeps all on.
    """

    alpha: float = DEFAULT_ALPHA          # Cache-Craft eq. 12 scale
    max_cfo: float = 1.0                  # CFO >= this -> compute fresh
    ca_window: int = DEFAULT_WINDOW       # CRAFT CA-Table sliding window (requests)
    promotion_threshold: int = DEFAULT_PROMOTION_THRESHOLD
    conversation_ttl_s: float = DEFAULT_TTL_S
    max_conversations: int = DEFAULT_MAX_CONVERSATIONS
    max_conversation_chunks: int = DEFAULT_MAX_CHUNKS  # a conversation remembers its last N chunks
    r_min: float = R_MIN                  # CacheBlend §5 minimum recompute ratio
    models: Mapping[str, ModelProfile] = field(default_factory=dict)  # model id -> profile
    default_model: ModelProfile = ModelProfile()
    tiers: Mapping[str, TierProfile] | None = None  # None: controller defaults
    dedup: bool = True
    reorder: bool = True
    prefix_tree: bool = True
    follow_prefix: bool = True            # reorder follows an existing CP-Tree path first
    variants: bool = True

    def __post_init__(self) -> None:
        if not self.alpha >= 0.0:
            raise ValueError(f"alpha must be >= 0, got {self.alpha}")
        if not 0.0 < self.max_cfo <= 1.0:
            raise ValueError(f"max_cfo must be in (0, 1], got {self.max_cfo}")


class ChunkPlan(NamedTuple):
    """What to do with one chunk of the final order (an immutable record; a NamedTuple
    because the planner builds one per chunk of every request).

    token_span: [start, end) of the chunk's tokens among this turn's chunk tokens.
    cfo: 0 for PREFIX, the chosen variant's CFO for VARIANT, 1 for FRESH.
    recompute: VARIANT only: token indices (within the chunk) to recompute, most
    contextualized first (Cache-Craft eq. 14), or highest learned score first when the
    variant has learned scores; FRESH computes every token.
    """

    chunk_key: str
    token_count: int
    position: int
    token_span: tuple[int, int]
    source: str
    variant_id: str | None
    tier: str | None
    cfo: float
    recompute: tuple[int, ...]

    @property
    def computed_tokens(self) -> int:
        """Tokens of this chunk whose KV the engine computes."""
        return self.token_count if self.source == FRESH else len(self.recompute)


class Plan(NamedTuple):
    """The planner's answer for one request (an immutable record).

    order: final chunk order of this turn (after dedup and reorder).
    dropped: chunk keys removed as conversation (or same-request) duplicates.
    prefix: variant ids of the CP-Tree prefix reused as is (the first len(prefix)
      chunks of `order`).
    chunks: one ChunkPlan per key of `order`.
    ratio: CacheBlend recompute ratio r: recomputing up to r of the reused tokens per
      layer hides behind loading (>= r_min).
    preload_depth: Lp, layers to fetch ahead (Cache-Craft eq. 16).
    history: the conversation's earlier chunks in send order (empty on a first turn);
      a chunk's prefix in the prompt is history + order[:position].
    """

    model_id: str
    conv_id: str
    first_turn: bool
    order: tuple[str, ...]
    dropped: tuple[str, ...]
    prefix: tuple[str, ...]
    chunks: tuple[ChunkPlan, ...]
    ratio: float
    preload_depth: int
    load_s_per_layer: float
    compute_s_per_layer: float
    history: tuple[str, ...]
    retrieved_tokens: int

    @property
    def computed_tokens(self) -> int:
        """Chunk tokens whose KV the engine computes (fresh + recompute)."""
        return sum(c.computed_tokens for c in self.chunks)

    @property
    def reuse_cfo(self) -> tuple[tuple[str, float], ...]:
        """(variant id, CFO) of every reused variant, for the store's fr update
        (Cache-Craft §3.3: fr += 1/CFO; see `variants.fr_increment`)."""
        return tuple((c.variant_id, c.cfo) for c in self.chunks if c.variant_id is not None)

    def prefix_of(self, position: int) -> tuple[str, ...]:
        """Chunk keys before `order[position]` in the prompt: the prefix a new
        variant of that chunk is stored under."""
        return self.history + self.order[:position]


def _chunk_table(model_id: str, chunks: Sequence[ChunkRef],
                 question_tokens: int) -> tuple[list[str], dict[str, int], int]:
    """Check the request; (keys in retriever order, key -> token count, tokens retrieved)."""
    if not model_id:
        raise PlanError("model_id is empty")
    if question_tokens < 0:
        raise PlanError(f"question_tokens is negative ({question_tokens})")
    tokens: dict[str, int] = {}
    keys: list[str] = []
    retrieved_tokens = 0
    for c in chunks:
        n = c.token_count
        if n < 1:
            raise PlanError(f"chunk {c.key!r} has token_count {n} < 1")
        keys.append(c.key)
        tokens[c.key] = n
        retrieved_tokens += n
    return keys, tokens, retrieved_tokens


def merged_scores(lists: Sequence[Sequence[float]]) -> Sequence[float]:
    """The learned scores of one chunk from those of its variants (one score per token
    each): their elementwise maximum, the rule `kvcraft.recompute.merge_scores` defines (a
    token whose stale KV cost an answer behind any prefix stays a candidate). Inlined
    because it runs for every reused chunk with learned scores: one list is returned as
    is, not copied, several are merged in one pass (tests compare it with folding the
    lists with merge_scores)."""
    if len(lists) == 1:
        return lists[0]
    return tuple(map(max, zip(*lists))) if lists else ()


def _spend_learned(plans: list[ChunkPlan], learned: Mapping[int, Sequence[float]], ratio: float) -> int:
    """The recompute of the chunks with learned scores (`learned`: plans index -> merged
    scores): the controller's ratio (recompute that hides behind loading, CacheBlend §5,
    >= r_min) of their tokens, spent prompt-wide on the highest scores across chunks
    (`kvcraft.recompute.allocate`) instead of Cache-Craft's per-chunk N (eq. 13-14).
    Fills those plans' `recompute`, highest score first; returns the tokens chosen."""
    chosen = 0
    for j, toks in allocate(learned, ratio).items():
        sc = learned[j]
        plans[j] = plans[j]._replace(recompute=tuple(sorted(toks, key=lambda t: (-sc[t], t))))
        chosen += len(toks)
    return chosen


class Planner:
    """CRAFT + Cache-Craft + CacheBlend planning over a `VariantCatalog`.

    The store must call the hooks after each metadata change, so that a plan never
    names a deleted variant:
      on_put(info)              a variant was stored (makes pending CP-Tree nodes live)
      on_evict(variant_id)      a variant was deleted
    A variant that changes tier needs no hook: the planner reads `Variant.tier`.
    The engine side reports timings for the controller's estimators through
    observe_load / observe_compute.
    """

    def __init__(self, catalog: VariantCatalog, config: PlannerConfig = PlannerConfig(),
                 clock: Callable[[], float] = time.monotonic, tiers: Sequence[str] | None = None) -> None:
        """tiers: names of the tiers the store runs, fastest first (the loading
        controller estimates those only); None: every tier with a profile."""
        self.catalog = catalog
        self.config = config
        self.tiers = tuple(tiers) if tiers is not None else None
        self.ca_table = CATable(config.ca_window)
        self.cp_tree = CPTree(catalog.get, config.promotion_threshold, pending_window=config.ca_window)
        self.conversations = ChunkMap(config.conversation_ttl_s, clock, config.max_conversations,
                                      config.max_conversation_chunks)
        self._controllers: OrderedDict[str, LoadingController] = OrderedDict()  # least recently planned first

    # ------------------------------------------------------------------ plan
    def plan(self, model_id: str, conv_id: str, chunks: Sequence[ChunkRef],
             question_tokens: int, first_turn: bool | None = None) -> Plan:
        """Plan one request: the steps of the module docstring, in that order.

        model_id: model fingerprint (`ModelSpec.fingerprint()`); picks the controller.
        conv_id: conversation id, "" for a single-turn request.
        chunks: retrieved chunks in retriever order.
        question_tokens: tokens after the chunks (question, turn text), always computed.
        first_turn: whether the chunks start the prompt. None: a turn is first when
          the conversation is unknown (or expired) to the planner. A caller that knows
          the prompt has history should pass False, so no CP-Tree prefix is used.
        """
        cfg = self.config
        keys, tokens, retrieved_tokens = _chunk_table(model_id, chunks, question_tokens)
        for i, c in enumerate(chunks):  # a count given with a key: the stored chunk's, or KV would land off its rows
            stored = self.catalog.variants_of(c.key)
            if stored and stored[0].token_count != c.token_count:
                raise PlanError(f"chunks[{i}] has token_count {c.token_count}, but chunk {c.key} is stored with "
                                f"{stored[0].token_count} tokens")
        history = self.conversations.history(conv_id)
        first = (history is None) if first_turn is None else first_turn
        order, dropped = self._dedup(keys, tokens, history)
        # Every retrieved chunk counts, dropped or not (CRAFT §4.2 "Table Update"); counting
        # before the reorder is the same as after: +1 to each chunk keeps their order.
        self.ca_table.observe(keys if len(tokens) == len(keys) else tokens, distinct=True)
        use_tree = first and cfg.prefix_tree  # a later turn's chunks follow its history: never a chunk-prefix
        if first and cfg.reorder and len(order) > 1:
            order = self._reorder(order, use_tree)
        nodes = self.cp_tree.lookup(order) if use_tree else []  # CP-Tree longest live prefix (CRAFT §4.1)
        plans, by_tier, fresh_tokens, recompute_total, learned = self._chunk_plans(order, tokens, nodes, history)
        hist_keys = tuple(history) if history else ()  # before _remember extends the history
        self._remember(conv_id, order, tokens, use_tree, len(nodes))
        controller = self.controller(model_id)  # the ratio does not depend on the recompute asked
        d = controller.decide(by_tier, fresh_tokens, question_tokens, recompute_total)
        if learned:
            recompute_total += _spend_learned(plans, learned, d.ratio)
            d = controller.decide(by_tier, fresh_tokens, question_tokens, recompute_total)
        return Plan(model_id, conv_id, first, tuple(order), tuple(dropped),
                    tuple([nd.variant_id for nd in nodes]), tuple(plans), d.ratio, d.preload_depth,
                    d.load_s_per_layer, d.compute_s_per_layer, hist_keys, retrieved_tokens)

    def _dedup(self, keys: list[str], tokens: dict[str, int],
               history: dict[str, int] | None) -> tuple[list[str], list[str]]:
        """Conversation dedup (CRAFT §4.3): (order, dropped), a chunk sent in an earlier
        turn, or earlier in this request, dropped."""
        if not self.config.dedup or (not history and len(tokens) == len(keys)):
            return keys, []  # nothing sent before, no key twice: nothing to drop
        return dedup(keys, history or ())

    def _reorder(self, order: list[str], use_tree: bool) -> list[str]:
        """Chunk reordering of a first turn (CRAFT §4.2): a stable sort by descending
        CA-Table count, then (follow_prefix) a CP-Tree path the chunks already form
        first, the rest after it in count order, so a chunk set seen before keeps the
        order its prefix was stored in."""
        order = reorder_by_count(order, self.ca_table.counts_of(order))
        if use_tree and self.config.follow_prefix:
            head = self.cp_tree.follow(order)
            if head:
                taken = set(head)
                order = head + [k for k in order if k not in taken]
        return order

    def _chunk_plans(self, order: list[str], tokens: dict[str, int], nodes: list[CPNode],
                     history: dict[str, int] | None
                     ) -> tuple[list[ChunkPlan], dict[str, int], int, int, dict[int, Sequence[float]]]:
        """One ChunkPlan per chunk of `order`: the CP-Tree prefix `nodes` as is (CRAFT
        §4.1, CFO 0), then for every other chunk the lowest-CFO variant (Cache-Craft §3.3),
        else FRESH; a variant's recompute tokens are its top ceil(CFO |C|) (eq. 14), or,
        when the chunk has learned scores, left to `_spend_learned`.

        Returns (plans, reused tokens per tier, fresh tokens, recompute tokens, learned:
        plans index -> merged learned scores).

        `variants.choose_variant` is inlined here, with fast paths for variants behind 0
        or 1 prefix chunks: this loop is the planner's hot path (tests check it picks
        what choose_variant picks).
        """
        cfg = self.config
        hist_len = len(history) if history else 0
        s_new: dict[str, int] = dict(history) if history else {}  # S_new: chunk -> prompt position
        plans: list[ChunkPlan] = []
        by_tier: dict[str, int] = {}
        start = 0
        new_chunk_plan = tuple.__new__  # ChunkPlan(...) minus NamedTuple's Python-level __new__ call
        for i, node in enumerate(nodes):
            k = order[i]
            n = tokens[k]
            plans.append(new_chunk_plan(ChunkPlan, (k, n, i, (start, start + n), PREFIX, node.variant_id, node.tier,
                                                    0.0, ())))
            start += n
            by_tier[node.tier] = by_tier.get(node.tier, 0) + n
            s_new[k] = hist_len + i

        variants_of = self.catalog.variants_of
        alpha, max_cfo = cfg.alpha, cfg.max_cfo
        use_variants = cfg.variants
        fresh_tokens = recompute_total = 0
        learned: dict[int, Sequence[float]] = {}
        for i in range(len(nodes), len(order)):
            k = order[i]
            n = tokens[k]
            span = (start, start + n)
            start += n
            best = None
            best_cfo = 2.0
            best_key = tie_key(None, s_new)
            learned_lists = []  # every variant's learned scores, not only the best's
            if use_variants:
                for v in variants_of(k):
                    st = v.stats
                    if len(st.recompute_scores) == n:
                        learned_lists.append(st.recompute_scores)
                    pk = v.prefix_keys
                    if len(pk) > 1:
                        c = variant_cfo(v, s_new, alpha)
                    else:
                        # No prefix, or one chunk: beta' is 1 when that chunk is in S_new
                        # (or both are empty), else 0 (eq. 6-8 with one key); CFO =
                        # alpha * CCI * (1 - beta'), clamped (eq. 12).
                        if (pk[0] in s_new) if pk else not s_new:
                            c = 0.0
                        else:
                            c = v.cci
                            if c < 0.0:
                                c = v.cci = cci(st.a, st.b)
                            c *= alpha
                            if c > 1.0:
                                c = 1.0
                    if c < best_cfo or (c == best_cfo and tie_key(v, s_new) < best_key):
                        best, best_cfo, best_key = v, c, tie_key(v, s_new)
            if best is None or best_cfo >= max_cfo:
                plans.append(new_chunk_plan(ChunkPlan, (k, n, i, span, FRESH, None, None, 1.0, ())))
                fresh_tokens += n
            else:
                if learned_lists:
                    # Learned scores describe the chunk's tokens, whichever variant a request
                    # stored them with: the budget is spent prompt-wide on them later.
                    learned[len(plans)] = merged_scores(learned_lists)
                    rc = ()
                else:
                    rc = tuple(best.recompute_order[: recompute_count(best_cfo, n)])
                plans.append(new_chunk_plan(ChunkPlan, (k, n, i, span, VARIANT, best.variant_id, best.tier,
                                                        best_cfo, rc)))
                recompute_total += len(rc)
                by_tier[best.tier] = by_tier.get(best.tier, 0) + n
            s_new[k] = hist_len + i
        return plans, by_tier, fresh_tokens, recompute_total, learned

    def _remember(self, conv_id: str, order: list[str], tokens: dict[str, int], use_tree: bool,
                  prefix_len: int) -> None:
        """The state a later request plans with: the CP-Tree promotes or extends this
        order's path (CRAFT §4.2 promotion), the ChunkMap records the chunks sent (§4.3)."""
        if use_tree and order:
            self.cp_tree.update(order, [tokens[k] for k in order], self.ca_table.count, prefix_len)
        if conv_id:
            self.conversations.record(conv_id, order)

    # ------------------------------------------------------------------ store hooks
    def on_put(self, info: Variant) -> None:
        """The store wrote a variant (after its metadata batch committed)."""
        self.cp_tree.on_put(info)

    def on_evict(self, variant_id: str) -> None:
        """The store deleted a variant."""
        self.cp_tree.on_evict(variant_id)

    def restore_prefix(self, keys: Sequence[str], token_counts: Sequence[int]) -> None:
        """Re-insert a chunk-prefix path at start-up (recovery from stored metadata);
        nodes whose variants are stored become live at once."""
        self.cp_tree.insert(keys, token_counts)

    # ------------------------------------------------------------------ engine timings
    def controller(self, model_id: str) -> LoadingController:
        """The model's loading controller; the MAX_MODELS most recently planned models keep
        theirs (a client naming ever new model ids cannot grow the planner without bound;
        a model dropped starts again from its profile)."""
        controllers = self._controllers
        c = controllers.get(model_id)
        if c is None:
            cfg = self.config
            c = LoadingController(cfg.models.get(model_id, cfg.default_model), cfg.tiers, cfg.r_min, self.tiers)
            controllers[model_id] = c
            if len(controllers) > MAX_MODELS:
                controllers.popitem(last=False)
        else:
            controllers.move_to_end(model_id)
        return c

    def observe_load(self, model_id: str, tier: str, nbytes_per_layer: float, seconds: float) -> None:
        """Engine report: loading one layer of `nbytes_per_layer` from `tier` took `seconds`."""
        self.controller(model_id).observe_load(tier, nbytes_per_layer, seconds)

    def observe_compute(self, model_id: str, tokens_per_layer: float, seconds: float) -> None:
        """Engine report: computing one layer for `tokens_per_layer` tokens took `seconds`."""
        self.controller(model_id).observe_compute(tokens_per_layer, seconds)
