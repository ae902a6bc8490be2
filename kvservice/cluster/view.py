"""The cluster-wide view: which variants exist on any node, and where prefixes live.

CRAFT (§4.1, hierarchical design) keeps a global CP-Tree with complete metadata and
a compact local tree per GPU holding only what resides there. Across kvcraft nodes:

- each node's planner keeps its local CP-Tree (kvservice.planner.cp_tree), over the
  variants its store holds, remote ones included once discovered;
- the global view lives in Mooncake Store itself: per chunk, a small variant list
  (kvservice.cluster.records). Variant ids are content hashes of (chunk, prefix), so
  the node of the global tree for chunk-prefix [c0 .. cj] is the variant
  `variant_id(cj, [c0 .. cj-1])`: walking a request's order and checking each of
  those ids against the lists finds the longest chunk-prefix stored anywhere, and
  each entry names the node that published it.

A node consults the view when it plans a request (`lookup`), and publishes every
variant it writes to the remote tier (`publish`). A lookup asks the master which of the
(chunks x slots) entries exist and where, reads them with one call per segment holding
some, all at once, and asks which of the payloads they name are stored. A segment that
does not answer (its node frozen or cut off) is skipped, and so are its entries and the
payloads in it (kvservice.cluster.silence): one silent node costs what it holds. A master
that is down makes the view empty: nodes plan from their local tiers, never fail a
request because of it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from kvcraft.keys import variant_id
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.cluster.mooncake import MooncakeClient
from kvservice.cluster.records import (BadRecord, Entry, decode_entry, encode_entry, payload_key, record_bytes,
                                       slot_key, slot_of)
from kvservice.errors import KVCraftError

if TYPE_CHECKING:
    from kvservice.index import Variant

log = logging.getLogger("kvcraft.cluster")

# What the cluster holds of a node's variant (`ClusterView.copies`): its copy, listed; its
# copy, not listed; another node's copy (other bytes), listed; no copy, or none listed.
LISTED, UNLISTED, ELSEWHERE, MISSING = "listed", "unlisted", "elsewhere", "missing"


@dataclass(frozen=True)
class PrefixHit:
    """The longest chunk-prefix of a request stored in the cluster."""

    length: int  # leading chunks of the order covered
    variant_ids: tuple[str, ...]
    holder: str  # node that published the deepest variant ("" when length == 0)


@dataclass(frozen=True)
class Lookup:
    """What the lists of some chunks hold now."""

    entries: list[Entry]  # valid entries whose payload is stored, in a segment that answers
    unknown: frozenset[str]  # chunks whose list, or a listed payload, lies in a silent segment


class ClusterView:
    def __init__(self, client: MooncakeClient, namespace: str, holder: str, slots: int = 8) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.client = client
        self.ns = namespace
        self.holder = holder
        self.slots = slots
        # List entries are a few hundred bytes: a segment that has not returned them in half
        # the transfer timeout is silent for this lookup (and skipped until it answers).
        self.read_timeout_s = client.settings.timeout_s / 2

    def payload_of(self, entry: Entry) -> str:
        """The key of the payload object the entry describes."""
        return payload_key(self.ns, entry.info.variant_id, entry.record)

    def publish(self, info: "pb.VariantInfo | Variant") -> bool:
        """List the variant's copy, in this node's segment; its payload must be in the
        cluster already, under its record. One copy of a variant id is listed at a time:
        False (nothing changed) when the slot lists another copy of this variant id whose
        payload is stored. An entry of another variant of the chunk, or of a copy that is
        gone, is replaced."""
        key = slot_key(self.ns, info.chunk_key, slot_of(info.variant_id, self.slots))
        value, record = encode_entry(info, self.holder), record_bytes(info)
        for _ in range(3):
            if self.client.create(key, value):
                return True
            listed = self._entry_at(key, info.chunk_key)
            if listed is not None and listed.info.variant_id == info.variant_id:
                if listed.record == record:
                    return True
                if self.client.exists([self.payload_of(listed)])[0]:
                    return False
            self.client.remove(key)
        return False  # others keep publishing into this slot: the next republish tries again

    def _entry_at(self, key: str, chunk: str) -> Entry | None:
        """The entry in slot `key` (None: none, altered, or in a silent segment)."""
        values, _ = self.client.read_small([key], self.read_timeout_s)
        try:
            return decode_entry(values[key], chunk) if key in values else None
        except BadRecord:
            return None

    def unpublish(self, chunk: str, vid: str, record: bytes) -> None:
        """Remove the entry of this copy of the variant, if its slot still lists it."""
        key = slot_key(self.ns, chunk, slot_of(vid, self.slots))
        values, _ = self.client.read_small([key], self.read_timeout_s)
        if key not in values:
            return
        try:
            e = decode_entry(values[key], chunk)
            if e.info.variant_id != vid or e.record != record:
                return
        except BadRecord:
            pass
        self.client.remove(key)

    def drop_entry(self, chunk: str, vid: str) -> None:
        """Remove the variant's list entry (best effort: the next node to read it drops it
        otherwise)."""
        self._remove(slot_key(self.ns, chunk, slot_of(vid, self.slots)))

    def discover(self, chunks: Sequence[str]) -> list[Entry]:
        """Every valid list entry of these chunks whose payload is stored (`lookup`)."""
        return self.lookup(chunks).entries

    def lookup(self, chunks: Sequence[str]) -> Lookup:
        """The valid list entries of these chunks whose payload is stored. Altered entries,
        and entries of payloads that are gone (their segment left the cluster with its node:
        the master drops them once the node's client_ttl has passed), are removed. Entries
        and payloads in a silent segment (a node frozen or cut off) are left out, their
        chunks `unknown`: the others are read without waiting for it."""
        chunk_of = {slot_key(self.ns, c, s): c for c in chunks for s in range(self.slots)}
        try:
            values, skipped = self.client.read_small(list(chunk_of), self.read_timeout_s)
            entries = self._decode(chunk_of, values)
            payloads = [self.payload_of(e) for _, e in entries]
            stored = self.client.exists(payloads)
            where = self.client.placements([p for p, s in zip(payloads, stored) if s]) if self.client.silent else {}
        except KVCraftError as e:
            log.warning("cluster view unavailable: %s", e)
            return Lookup([], frozenset(chunks))
        unknown = {chunk_of[k] for k in skipped}
        out = []
        for (key, e), payload, there in zip(entries, payloads, stored):
            if not there:
                log.info("dropping list entry %s: its payload is gone from the cluster", key)
                self._remove(key)
            elif where.get(payload) in self.client.silent:
                unknown.add(e.info.chunk_key)
            else:
                out.append(e)
        return Lookup(out, frozenset(unknown))

    def copies(self, variants: Sequence["Variant"]) -> list[str]:
        """What the cluster holds of each of this node's variants: LISTED, UNLISTED,
        ELSEWHERE or MISSING (a list slot in a silent segment counts as not listing it).
        Unavailable when the master does not answer."""
        records = [record_bytes(v) for v in variants]
        own = self.client.exists([payload_key(self.ns, v.variant_id, r) for v, r in zip(variants, records)])
        keys = [slot_key(self.ns, v.chunk_key, slot_of(v.variant_id, self.slots)) for v in variants]
        values, _ = self.client.read_small(keys, self.read_timeout_s)
        listed: list[Entry | None] = []
        for v, key in zip(variants, keys):
            try:
                e = decode_entry(values[key], v.chunk_key) if key in values else None
            except BadRecord:
                e = None
            listed.append(e if e is not None and e.info.variant_id == v.variant_id else None)
        others = [e for e, r in zip(listed, records) if e is not None and e.record != r]
        alive = dict(zip([id(e) for e in others], self.client.exists([self.payload_of(e) for e in others])))
        out = []
        for e, r, mine in zip(listed, records, own):
            if e is not None and e.record == r and mine:
                out.append(LISTED)
            elif e is not None and e.record != r and alive[id(e)]:
                out.append(ELSEWHERE)
            else:
                out.append(UNLISTED if mine else MISSING)
        return out

    def _decode(self, chunk_of: dict[str, str], values: dict[str, bytes]) -> list[tuple[str, Entry]]:
        out = []
        for key, raw in values.items():
            try:
                out.append((key, decode_entry(raw, chunk_of[key])))
            except BadRecord as e:
                log.warning("dropping list entry %s: %s", key, e)
                self._remove(key)
        return out

    def _remove(self, key: str) -> None:
        try:
            self.client.remove(key)
        except KVCraftError:
            pass

    def longest_prefix(self, order: Sequence[str], entries: Sequence[Entry] | None = None) -> PrefixHit:
        """The global CP-Tree lookup: the longest leading run of `order` whose
        prefix-exact variants are all listed (any node), and who published its end."""
        if entries is None:
            entries = self.discover(order)
        by_id = {e.info.variant_id: e for e in entries}
        vids: list[str] = []
        holder = ""
        for j, chunk in enumerate(order):
            vid = variant_id(chunk, order[:j])
            e = by_id.get(vid)
            if e is None:
                break
            vids.append(vid)
            holder = e.holder
        return PrefixHit(len(vids), tuple(vids), holder)
