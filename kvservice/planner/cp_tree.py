"""Chunk-Prefix Tree (CRAFT §4.1 "Chunk-Prefix Tree", §4.2 lookup and table update).

A radix tree over chunk keys: each node is one chunk, and the path from the root to
a node is a chunk-prefix. A node records (chunk key, variant ref, token span): the
variant is the chunk's KV computed behind exactly the chunks on the path above it
(`variant_id(chunk_key, path_keys)`), and the token span is [start, end) of the
chunk's tokens inside the prefix. Where that KV lives (CRAFT's per-node tier) is read
from the variant's own record, the one the store keeps (`index.Variant.tier`): a
node holds that record, not a copy of its tier, so a move needs no update here.

Lookup walks from the root and returns the longest matching path whose KV is
resident; any sub-prefix of a longer path is reusable ("prefix slicing"). `follow`
finds, for a request's chunk set, a path already in the tree (live or pending), so a
chunk set seen before keeps the order it had.

Update after each request (CRAFT §4.2 "Table Update and Maintenance"), with the
CA-Table already counting the request:
  * promotion: if no prefix was reused, the leading chunks of the request that all
    reach the threshold (default 2, CRAFT §6.2.5) are inserted as a path;
  * extension: if a prefix of length p was reused and the chunk after it reaches
    the threshold, it is inserted as a child of the prefix's last node (one chunk
    per request, as in the paper's Example).
A node inserted this way may refer to a variant the engine has not stored yet (it
stores new KV in the background after prefill). Such a node is *pending* (no variant
record) and lookups stop at it; `on_put` makes it live; `on_evict` removes the node
and its subtree (their prefixes can no longer be formed without it), so a lookup
never returns a deleted variant. The variants below stay in the store for
Cache-Craft reuse; re-promotion finds them again through the catalog.

In CRAFT a promoted prefix's KV exists (the GPU just computed it); here the engine may
never store it (it stored a variant behind another order, its Store failed, it has no
store path at all). A node still pending `pending_window` requests after its insertion
(default: the CA-Table's window, whose counts promoted it) is removed with its subtree,
as if its KV had been evicted. Without that the tree grew by ~2 nodes per request for
good when nothing was stored (560,000 nodes after 300,000 requests, planning 29% slower).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable, Sequence

from kvcraft.keys import variant_id as _variant_id

if TYPE_CHECKING:
    from kvservice.index import Variant

from .ca_table import DEFAULT_WINDOW as DEFAULT_PENDING_WINDOW

DEFAULT_PROMOTION_THRESHOLD = 2


class CPNode:
    """One chunk on a chunk-prefix path."""

    __slots__ = ("chunk_key", "variant_id", "variant", "token_span", "children", "parent")

    def __init__(self, chunk_key: str, variant_id: str, variant: "Variant | None",
                 token_span: tuple[int, int], parent: "CPNode | None") -> None:
        self.chunk_key = chunk_key
        self.variant_id = variant_id
        self.variant = variant  # the stored variant's record; None: pending, not stored (yet)
        self.token_span = token_span
        self.children: dict[str, CPNode] = {}
        self.parent = parent

    @property
    def live(self) -> bool:
        return self.variant is not None

    @property
    def tier(self) -> str | None:
        """Where the variant lives (its record's fastest tier); None while pending."""
        v = self.variant
        return None if v is None else v.tier

    def __repr__(self) -> str:
        return f"CPNode({self.chunk_key[:8]}, tier={self.tier}, span={self.token_span})"


def _best_path(node: CPNode, want: dict[str, int],
               used: frozenset[str]) -> tuple[tuple[int, int, tuple[int, ...]], list[str]]:
    """`CPTree.follow`'s search below `node`: (length, live nodes, -positions in `want`)
    and the path. A module function, not a nested one: a nested function that calls
    itself is a reference cycle (function -> cell -> function) that only the cyclic
    collector frees, and one per Plan made its pauses (~250 µs each at 1M variants) land
    in ~1% of Plans."""
    top: tuple[tuple[int, int, tuple[int, ...]], list[str]] = ((0, 0, ()), [])
    # Visit only children whose chunk is wanted: the root has one child per
    # promoted first chunk (thousands), a request names a handful.
    children = node.children
    for k in want:
        child = children.get(k)
        if child is None or k in used:
            continue
        (n, live, rank), path = _best_path(child, want, used | {k})
        cand = ((n + 1, live + (child.variant is not None), (-want[k],) + rank), [k] + path)
        if cand[0] > top[0]:
            top = cand
    return top


class CPTree:
    """CRAFT CP-Tree (the global, CPU-side tree; per-GPU trees are out of scope).

    variant_of(variant_id) -> the stored variant's record or None (the catalog's `get`)
    tells, when a node is inserted, whether its variant is already stored (e.g. a
    variant of an evicted-then-re-promoted path).
    """

    def __init__(self, variant_of: Callable[[str], "Variant | None"],
                 threshold: int = DEFAULT_PROMOTION_THRESHOLD,
                 variant_id_fn: Callable[[str, Sequence[str]], str] = _variant_id,
                 pending_window: int = DEFAULT_PENDING_WINDOW) -> None:
        if threshold < 1:
            raise ValueError(f"promotion threshold must be >= 1, got {threshold}")
        if pending_window < 1:
            raise ValueError(f"pending_window must be >= 1, got {pending_window}")
        self.threshold = threshold
        self.pending_window = pending_window
        self._updates = 0  # requests seen by `update`
        self._pending: deque[tuple[int, CPNode]] = deque()  # (update number, node) of nodes inserted pending
        self._variant_of = variant_of
        self._vid = variant_id_fn
        self._root = CPNode("", "", None, (0, 0), None)
        self._by_variant: dict[str, CPNode] = {}

    # ------------------------------------------------------------------ lookup
    def lookup(self, keys: Sequence[str]) -> list[CPNode]:
        """Longest live chunk-prefix of `keys` (CRAFT §4.2 "Chunk-Prefix Lookup")."""
        out: list[CPNode] = []
        node = self._root
        for k in keys:
            child = node.children.get(k)
            if child is None or child.variant is None:
                break
            out.append(child)
            node = child
        return out

    def follow(self, keys: Sequence[str]) -> list[str]:
        """The longest existing path made only of chunks in `keys` (CRAFT §4.2: a request
        follows a chunk-prefix already in the tree before the rest is reordered, so the
        same chunk set gets the order it had). Among equally long paths: the one with
        more live nodes, then the one whose chunks come first in `keys` (the caller passes
        its count-sorted order). Only nodes whose chunk is in `keys` are visited."""
        roots = self._root.children
        want = {k: i for i, k in enumerate(keys)}
        if not any(k in roots for k in want):
            return []  # most requests: no promoted path starts with any of their chunks
        return _best_path(self._root, want, frozenset())[1]

    # ------------------------------------------------------------------ update
    def update(self, keys: Sequence[str], token_counts: Sequence[int],
               count: Callable[[str], int], reused: int) -> list[CPNode]:
        """Promotion / extension after a request whose final chunk order is `keys`
        and which reused its first `reused` chunks from this tree. Returns the nodes
        inserted (pending or live); removes the nodes still pending `pending_window`
        requests after their insertion."""
        self._updates += 1
        th = self.threshold
        inserted: list[CPNode] = []
        if reused == 0:
            # Promotion: the leading chunks that all reach the threshold.
            n = 0
            while n < len(keys) and count(keys[n]) >= th:
                n += 1
            inserted = self._insert_path(keys[:n], token_counts)
        elif reused < len(keys) and count(keys[reused]) >= th:
            # Extension: the one chunk after the reused prefix.
            inserted = self._insert_path(keys[: reused + 1], token_counts)
        pending = self._pending
        pending.extend((self._updates, node) for node in inserted if node.variant is None)
        horizon = self._updates - self.pending_window
        while pending and pending[0][0] <= horizon:
            node = pending.popleft()[1]
            if node.variant is None and node.parent is not None:  # still pending, still in the tree
                self._remove(node)
        return inserted

    def insert(self, keys: Sequence[str], token_counts: Sequence[int]) -> list[CPNode]:
        """Insert a path unconditionally (recovery from stored metadata, tests)."""
        return self._insert_path(keys, token_counts)

    def _insert_path(self, keys: Sequence[str], token_counts: Sequence[int]) -> list[CPNode]:
        inserted: list[CPNode] = []
        node = self._root
        start = 0
        for i, k in enumerate(keys):
            end = start + token_counts[i]
            child = node.children.get(k)
            if child is None:
                vid = self._vid(k, keys[:i])
                child = CPNode(k, vid, self._variant_of(vid), (start, end), node)
                node.children[k] = child
                self._by_variant[vid] = child
                inserted.append(child)
            node = child
            start = end
        return inserted

    # ------------------------------------------------------------------ store hooks
    def on_put(self, variant: "Variant") -> None:
        """A variant was stored: a pending node referring to it becomes live. (A move to
        another tier needs no hook, CRAFT §4.2's "entries are updated to reflect the new
        location": the node reads the tier from this record, which the store updates.)"""
        node = self._by_variant.get(variant.variant_id)
        if node is not None:
            node.variant = variant

    def on_evict(self, variant_id: str) -> None:
        """A variant was deleted: remove its node and the subtree below it."""
        node = self._by_variant.get(variant_id)
        if node is not None:
            self._remove(node)

    def _remove(self, node: CPNode) -> None:
        del node.parent.children[node.chunk_key]
        stack = [node]
        while stack:
            n = stack.pop()
            self._by_variant.pop(n.variant_id, None)
            stack.extend(n.children.values())
            n.children = {}
            n.parent = None

    # ------------------------------------------------------------------ inspection
    def node_of(self, variant_id: str) -> CPNode | None:
        return self._by_variant.get(variant_id)

    def paths(self, live_only: bool = True) -> list[tuple[str, ...]]:
        """Every root-to-node path (live ones: all nodes on it live)."""
        out: list[tuple[str, ...]] = []
        stack: list[tuple[CPNode, tuple[str, ...]]] = [(self._root, ())]
        while stack:
            node, path = stack.pop()
            for k, child in node.children.items():
                if live_only and child.variant is None:
                    continue
                p = path + (k,)
                out.append(p)
                stack.append((child, p))
        return out

    def __len__(self) -> int:
        return len(self._by_variant)
