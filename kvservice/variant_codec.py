"""A variant's record as bytes: a serialized kvcraft.v1.VariantInfo, the one stored
format of `index.Variant` (docs/storage.md, "Disk format" and "Metadata").

The same bytes are the RocksDB value of a variant (`kvservice.metadata`), the record a
payload file carries after its layers (`TierWriter.describe`, recovery's adoption) and,
in scale-out, a remote object's header (kvservice.cluster). Below the server edge this
is the one module that speaks protobuf: the store hands it plain records and gets plain
records back (the import contract in pyproject.toml keeps protobuf out of the store).
"""

from __future__ import annotations

from array import array

from google.protobuf.message import DecodeError

from kvcraft.layout import layer_layout
from kvcraft.records import VariantStats
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.errors import InvalidArgument
from kvservice.index import InvalidVariant, Spec, Variant, VariantIndex


class Undecodable(ValueError):
    """Bytes that are not a variant record."""


def encode(v: Variant) -> bytes:
    return variant_message(v).SerializeToString()


def parse(raw: bytes) -> pb.VariantInfo:
    """The message `raw` holds; Undecodable if it holds none."""
    info = pb.VariantInfo()
    try:
        info.ParseFromString(raw)
    except DecodeError as e:
        raise Undecodable(str(e)) from None
    return info


def decode(idx: VariantIndex, raw: bytes) -> Variant | None:
    """The record `raw` holds (its parts interned in `idx`, not added to it); None if
    the bytes are no record or the record contradicts itself."""
    try:
        return to_variant(idx, parse(raw))
    except Undecodable:
        return None


def to_variant(idx: VariantIndex, info: pb.VariantInfo) -> Variant | None:
    """The in-memory record of a stored one (its specs, keys and layout interned in
    `idx`; not added to it), or None if it contradicts itself. Its `tier` is empty: the
    store sets it from the tiers that hold the payload."""
    key_spec = idx.intern_spec(Spec(info.key_spec.dtype, tuple(info.key_spec.shape)))
    value_spec = idx.intern_spec(Spec(info.value_spec.dtype, tuple(info.value_spec.shape)))
    try:
        layout = idx.intern_layout(layer_layout(key_spec, value_spec, info.token_count))
        return Variant.build(
            info.variant_id, idx.intern_key(info.chunk_key), tuple(idx.intern_key(k) for k in info.prefix_keys),
            info.token_count, "", stats_record(info.stats), model_id=info.model_id, num_layers=info.num_layers,
            key_spec=key_spec, value_spec=value_spec, layout=layout, layer_checksums=array("Q", info.layer_checksums),
            fr=info.fr, last_access_ms=info.last_access_unix_ms, created_ms=info.created_unix_ms,
            pinned=info.pinned)
    except (InvalidArgument, InvalidVariant, ValueError):
        return None


def spec_message(s: Spec | None) -> pb.TensorSpec | None:
    return None if s is None else pb.TensorSpec(dtype=s.dtype, shape=s.shape)


def stats_record(s: pb.VariantStats) -> VariantStats:
    """Per-token numbers as a float32 array (4 bytes a token, as on the wire), the rest as tuples."""
    return VariantStats(s.a, s.b, tuple(s.prefix_attention), array("f", s.token_inter_attention),
                        array("f", s.recompute_scores))


def variant_message(v: Variant, leased: bool = False) -> pb.VariantInfo:
    """The message of a record: what is stored (leased False), and what Lookup and
    GetChunk answer (`kvservice.wire`)."""
    st = v.stats
    return pb.VariantInfo(
        variant_id=v.variant_id, chunk_key=v.chunk_key, model_id=v.model_id, prefix_keys=v.prefix_keys,
        token_count=v.token_count, num_layers=v.num_layers, key_spec=spec_message(v.key_spec),
        value_spec=spec_message(v.value_spec),
        stats=pb.VariantStats(a=st.a, b=st.b, prefix_attention=st.prefix_attention,
                              token_inter_attention=st.token_inter_attention,
                              recompute_scores=st.recompute_scores),
        tier=v.tier, size_bytes=v.size_bytes, fr=v.fr, last_access_unix_ms=v.last_access_ms,
        created_unix_ms=v.created_ms, pinned=v.pinned, leased=leased, layer_checksums=v.layer_checksums)
