"""What kvcraft writes into Mooncake Store: payload objects and variant list entries.

Keys (all under one namespace, so several deployments can share a cluster):
  {ns}/v/{variant_id}/{digest}   payload object: header + payload; digest: xxh3-64 of the
                                 record its header carries
  {ns}/c/{chunk_key}/{slot}      one entry of the chunk's variant list
  kvcraft/segment/{endpoint}     a node's mark in its own segment (kvservice.cluster.watch)

Two nodes that compute one variant (same chunk, same prefix) need not compute the same
bytes (kernels round differently at other batch shapes); each copy's key names its record,
so a list entry, which carries the record, names exactly the object that carries it, and an
object is never rewritten once complete: a listing always describes the bytes it points to.
Nodes that computed the same bytes write the same record, hence the same key: one copy.

Payload object = header, then the payload exactly as the local tiers hold it (per
layer K then V, docs/storage.md). The header makes it self-describing:

  0   8  magic b"KVCRAFT\\x01"
  8   4  header length (a multiple of 64: the payload starts aligned)
  12  4  record length
  16  8  payload length
  24  8  xxh3-64 of the record
  32  8  xxh3-64 of bytes 0..32
  40  .  record: the variant's `VariantInfo` in canonical form (below), with the
         per-layer checksums the payload is verified against
  ..     zero padding up to the header length

Canonical record: the node-local fields (tier, fr, access and creation times, pin,
lease) are cleared, so every node that stores the same variant id writes the same
record. A reader takes the record from the variant list, computes the header length
from it, reads header and payload in one call, and accepts the payload only when the
header carries that same record and every layer matches its checksum.

A variant list entry names one variant, with its record, and the node that published it
(the node that computed it and holds it in its local tiers: where a request for that
chunk-prefix is best routed). An entry is its own object, one per slot (slot = variant id
mod the slot count), so two nodes publishing variants of one chunk never overwrite each
other's list; two variants hashing to one slot keep the later one (the list is a cache
too). One copy of a variant id is listed at a time: the first one published, until its
payload leaves the cluster (kvservice.cluster.view).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash
from google.protobuf.message import DecodeError

from kvcraft.keys import is_key, variant_id
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.index import Variant
from kvservice.wire import variant_message

MAGIC = b"KVCRAFT\x01"
ENTRY_MAGIC = b"KVCRLST\x01"
_HEAD = struct.Struct("<8sIIQQQ")  # magic, header len, record len, payload len, xxh3(record), xxh3(head)
_ENTRY = struct.Struct("<8sIIQ")  # magic, record len, holder len, xxh3(record + holder)
ALIGN = 64
REMOTE = "remote"


class BadRecord(ValueError):
    """Bytes that are not a valid kvcraft header or list entry (altered or foreign)."""


def payload_key(ns: str, vid: str, record: bytes) -> str:
    """The key of the copy of variant `vid` whose header carries `record` (`record_bytes`)."""
    return f"{ns}/v/{vid}/{xxhash.xxh3_64_intdigest(record):016x}"


def slot_key(ns: str, chunk: str, slot: int) -> str:
    return f"{ns}/c/{chunk}/{slot}"


def slot_of(vid: str, slots: int) -> int:
    return int(vid[:8], 16) % slots


def canonical(record: "pb.VariantInfo | Variant") -> pb.VariantInfo:
    """The record every node writes for this variant: node-local fields cleared."""
    out = pb.VariantInfo()
    out.CopyFrom(record if isinstance(record, pb.VariantInfo) else variant_message(record))
    for f in ("tier", "fr", "last_access_unix_ms", "created_unix_ms", "pinned", "leased"):
        out.ClearField(f)
    return out


def record_bytes(info: "pb.VariantInfo | Variant") -> bytes:
    return canonical(info).SerializeToString(deterministic=True)


def header_length(record: bytes) -> int:
    return -(-(_HEAD.size + len(record)) // ALIGN) * ALIGN


def encode_header(record: bytes, payload_len: int) -> bytes:
    n = header_length(record)
    head = struct.pack("<8sIIQQ", MAGIC, n, len(record), payload_len, xxhash.xxh3_64_intdigest(record))
    out = bytearray(n)
    out[: _HEAD.size] = head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))
    out[_HEAD.size : _HEAD.size + len(record)] = record
    return bytes(out)


def check_header(header: bytes | bytearray | memoryview, record: bytes, payload_len: int) -> None:
    """Raise BadRecord unless `header` is exactly the header of `record` + payload."""
    if len(header) < _HEAD.size:
        raise BadRecord("header is truncated")
    magic, n, rlen, plen, rsum, hsum = _HEAD.unpack_from(header)
    if magic != MAGIC:
        raise BadRecord("not a kvcraft payload object (bad magic)")
    if xxhash.xxh3_64_intdigest(bytes(header[: _HEAD.size - 8])) != hsum:
        raise BadRecord("header checksum mismatch")
    if n != len(header) or n != header_length(record) or rlen != len(record) or plen != payload_len:
        raise BadRecord(f"header describes another object (header {n}, record {rlen}, payload {plen} bytes)")
    if bytes(header[_HEAD.size : _HEAD.size + rlen]) != record or xxhash.xxh3_64_intdigest(record) != rsum:
        raise BadRecord("header carries another record")


def encode_entry(info: "pb.VariantInfo | Variant", holder: str) -> bytes:
    record = record_bytes(info)
    h = holder.encode()
    return _ENTRY.pack(ENTRY_MAGIC, len(record), len(h), xxhash.xxh3_64_intdigest(record + h)) + record + h


@dataclass(frozen=True)
class Entry:
    """A decoded, validated variant list entry."""

    info: pb.VariantInfo  # canonical record, tier set to "remote"
    record: bytes  # the exact record bytes (the payload header must carry these)
    holder: str  # the publishing node's address


def decode_entry(raw: bytes, chunk: str) -> Entry:
    if len(raw) < _ENTRY.size:
        raise BadRecord("list entry is truncated")
    magic, rlen, hlen, total = _ENTRY.unpack_from(raw)
    body = raw[_ENTRY.size :]
    if magic != ENTRY_MAGIC or len(body) != rlen + hlen or xxhash.xxh3_64_intdigest(body) != total:
        raise BadRecord("list entry fails its checksum")
    record = body[:rlen]
    info = pb.VariantInfo()
    try:
        info.ParseFromString(record)
    except DecodeError:
        raise BadRecord("list entry record does not parse") from None
    if info.chunk_key != chunk or not all(is_key(p) for p in info.prefix_keys):
        raise BadRecord("list entry names another chunk")
    if info.variant_id != variant_id(info.chunk_key, info.prefix_keys):
        raise BadRecord("list entry's variant id does not hash from its chunk and prefix")
    if len(info.layer_checksums) != info.num_layers or info.num_layers < 1:
        raise BadRecord("list entry has no checksum per layer")
    info.tier = REMOTE
    return Entry(info, record, body[rlen:].decode(errors="replace"))

