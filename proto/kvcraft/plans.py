"""A Plan's answer as plain records (`Plan`, `ChunkPlan`), and its chunk keys without
repeating them (kvcraft.v1.PlanResponse).

`Plan` is what KVClient.plan and AsyncKVClient.plan return: kvcraft.v1.PlanResponse
field for field, in plain Python (kvclient.messages.plan_of converts; the wire stays
protobuf). It pickles, so it crosses process boundaries as it is.

A chunk key is 34 bytes on the wire. A response names each key once: the conversation's
earlier chunks (`history`), this turn's order (`order`), and the keys chosen variants
were computed behind that are in neither (`other_keys`). Together, in that order, they
are the response's key table.

- A chunk's prompt prefix (where a new variant of it is stored) is history ++
  order[:position]: not sent.
- The prefix its chosen variant was computed behind is the first
  `variant_prefix_length` keys of one of the response's `variant_prefixes` (chains of
  table indices, each sent as (start, count) runs: `KeyChain`). Prefixes that nest
  share a chain: variants stored by one earlier request (behind its 1st, 2nd, ...
  chunks) cost one chain however many of them the plan reuses, and an exact variant
  (computed behind this very prompt prefix) is a run or two of the table.

Sending keys instead cost a key per earlier chunk for every chunk, twice (the prompt
prefix and the variant's): 4.3 KB a chunk at 256 chunks, 8.8 KB with reused variants.

`KeyTable` encodes (the service); `prefix_keys` and `variant_prefixes` decode (clients),
from a `Plan` or a PlanResponse alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Iterable, NamedTuple, Protocol, Sequence


class Source(IntEnum):
    """Where a chunk's KV comes from (kvcraft.v1.ChunkPlan.Source; the same numbers)."""

    UNSPECIFIED = 0
    FRESH = 1    # no usable variant: compute every token
    PREFIX = 2   # CRAFT chunk-prefix: load the variant, recompute nothing
    VARIANT = 3  # Cache-Craft: load the variant, recompute `recompute` tokens


class KeyChain(NamedTuple):
    """A sequence of chunk keys as flattened (start, count) runs of indices into the
    plan's key table (history ++ order ++ other_keys)."""

    ranges: tuple[int, ...] = ()


class ChunkPlan(NamedTuple):
    """What to do with one chunk of the final order (kvcraft.v1.ChunkPlan). An immutable
    record; a NamedTuple because the client builds one per chunk of every answer (half
    the cost of a frozen dataclass's)."""

    chunk_key: str
    position: int                 # index in Plan.order
    token_start: int              # first token among this turn's chunk tokens
    token_count: int              # tokens of the chunk
    source: Source
    variant_id: str = ""          # PREFIX / VARIANT: the variant to fetch; empty for FRESH
    tier: str = ""                # PREFIX / VARIANT: where it is now ("gpu", "host", "disk", "remote")
    cfo: float = 0.0              # Cache-Craft eq. 12, in [0, 1]; pass it back in Ref.cfo
    recompute: tuple[int, ...] = ()  # VARIANT: token indices in the chunk to recompute, most contextualized first
    # PREFIX / VARIANT: the chosen variant was computed behind the first
    # variant_prefix_length keys of Plan.variant_prefixes[variant_prefix_chain - 1]; chain 0:
    # computed alone (`variant_prefixes` decodes them; `prefix_keys` gives the chunk's own
    # prompt prefix, under which a new variant of it is stored)
    variant_prefix_chain: int = 0
    variant_prefix_length: int = 0

    @property
    def reused(self) -> bool:
        """The plan loads a stored variant of this chunk (PREFIX or VARIANT)."""
        return self.source in (Source.PREFIX, Source.VARIANT)


@dataclass(frozen=True)
class Plan:
    """The service's plan of one RAG request (kvcraft.v1.PlanResponse): chunk order,
    variant choice, recompute lists and the lease that holds the variants (Release it)."""

    order: tuple[str, ...]              # final chunk order of this turn (chunk keys)
    chunks: tuple[ChunkPlan, ...]       # one per key of order, in order
    dropped: tuple[str, ...] = ()       # duplicates of earlier turns (or of this one), removed
    history: tuple[str, ...] = ()       # the conversation's earlier chunks, in send order
    ratio: float = 0.0                  # CacheBlend recompute ratio r, in [0, 1]
    preload_depth: int = 0              # Lp (Cache-Craft eq. 16): layers to fetch ahead
    load_s_per_layer: float = 0.0       # the loading controller's estimate, seconds
    compute_s_per_layer: float = 0.0    # seconds
    lease_id: str = ""                  # holds every variant named in chunks; Release it
    lease_expires_unix_ms: int = 0
    computed_tokens: int = 0            # chunk tokens the engine computes (fresh + recompute)
    other_keys: tuple[str, ...] = ()    # the key table's tail (module docstring)
    variant_prefixes: tuple[KeyChain, ...] = ()  # the prefixes chosen variants were computed behind
    recompute_budget: float = 0.0       # the fidelity controller's budget (1: exact reuse only); 0: none set
    fidelity_sample: bool = False       # measure this request against full prefill (docs/quality.md)
    fidelity_below: float = 0.0         # with fidelity_sample: the budget the shadow also blends at; 0: none
    no_reuse: bool = False              # with budget 1: serve no stored KV, full prefill
    near_tie: float = 0.0               # a blend whose first token leads by less is served in full; 0: none


class _Chain(Protocol):
    ranges: Sequence[int]


class _Chunk(Protocol):
    position: int
    variant_prefix_chain: int
    variant_prefix_length: int


class _Plan(Protocol):  # a Plan or a kvcraft.v1.PlanResponse, as far as this module reads it
    history: Sequence[str]
    order: Sequence[str]
    other_keys: Sequence[str]
    variant_prefixes: Sequence[_Chain]
    chunks: Sequence[_Chunk]


class KeyTable:
    """The key table and prefix chains of one response under construction.

    `chain(keys)` places a variant's prefix: in a trie of table indices whose nodes
    remember the chain that made them, a prefix that ends on a known path is a length
    along that path's chain; one that goes further extends the chain if the path ends
    it, else starts a chain of its own (the shared part copied: a run or two). Every
    node at depth d of chain c satisfies chains[c][:d] == the path to it."""

    def __init__(self, history: Sequence[str], order: Sequence[str]) -> None:
        self._index = {k: i for i, k in enumerate((*history, *order))}
        self.other: list[str] = []  # keys met that neither history nor order holds
        self.chains: list[list[int]] = []
        self._child: dict[tuple[int, int], int] = {}  # (node, table index) -> node; node 0 is the root
        self._chain_of: list[int] = [-1]  # node -> the chain that made it (-1: the root)

    def _id(self, key: str) -> int:
        i = self._index.get(key)
        if i is None:
            i = self._index[key] = len(self._index)
            self.other.append(key)
        return i

    def chain(self, keys: Sequence[str]) -> tuple[int, int]:
        """(chain number from 1, length) of `keys`; (0, 0) for none."""
        if not keys:
            return 0, 0
        ids = [self._id(k) for k in keys]
        child, node, depth = self._child, 0, 0
        for i in ids:
            nxt = child.get((node, i))
            if nxt is None:
                break
            node, depth = nxt, depth + 1
        c = self._chain_of[node]
        if depth == len(ids):
            return c + 1, depth
        if c < 0 or len(self.chains[c]) != depth:  # the path goes on along its chain: branch off
            self.chains.append(self.chains[c][:depth] if c >= 0 else [])
            c = len(self.chains) - 1
        self.chains[c] += ids[depth:]
        for i in ids[depth:]:
            self._chain_of.append(c)
            child[(node, i)] = node = len(self._chain_of) - 1
        return c + 1, len(ids)

    def chain_ranges(self) -> list[list[int]]:
        """Each chain as flattened (start, count) runs (KeyChain.ranges)."""
        return [runs(c) for c in self.chains]


def runs(ids: Iterable[int]) -> list[int]:
    out: list[int] = []
    for i in ids:
        if out and out[-2] + out[-1] == i:
            out[-1] += 1
        else:
            out += (i, 1)
    return out


def key_table(plan: _Plan) -> list[str]:
    return [*plan.history, *plan.order, *plan.other_keys]


def prefix_keys(plan: _Plan, chunk: _Chunk) -> list[str]:
    """The chunk keys before `chunk` in the prompt: a new variant of it is stored under these."""
    return [*plan.history, *plan.order[: chunk.position]]


def chain_keys(table: Sequence[str], ranges: Sequence[int]) -> list[str]:
    if len(ranges) % 2:
        raise ValueError(f"a KeyChain has {len(ranges)} numbers; expected (start, count) pairs")
    out: list[str] = []
    for j in range(0, len(ranges), 2):
        start, count = ranges[j], ranges[j + 1]
        if start + count > len(table):
            raise ValueError(f"KeyChain range ({start}, {count}) is past the key table's {len(table)} keys")
        out += table[start : start + count]
    return out


def variant_prefixes(plan: _Plan) -> list[tuple[str, ...]]:
    """Per chunk of the plan, in order: the chunk keys its chosen variant was computed
    behind (empty for a fresh chunk, or a variant computed alone)."""
    table = key_table(plan)
    chains = [chain_keys(table, c.ranges) for c in plan.variant_prefixes]
    out = []
    for c in plan.chunks:
        n = c.variant_prefix_chain
        if not n:
            out.append(())
            continue
        if n > len(chains) or c.variant_prefix_length > len(chains[n - 1]):
            raise ValueError(f"chunk at position {c.position}: variant prefix ({n}, {c.variant_prefix_length}) "
                             f"is past the response's {len(chains)} variant_prefixes")
        out.append(tuple(chains[n - 1][: c.variant_prefix_length]))
    return out
