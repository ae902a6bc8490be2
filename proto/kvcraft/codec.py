"""The two messages that carry layer bytes, encoded and decoded by hand.

`StoreRequest{layer: LayerPayload}` (client -> server) and `LayerChunk` (server ->
client) are almost all K and V bytes. Going through protobuf objects costs a copy per
step (tensor -> bytes, bytes -> message, message -> wire; and back: wire -> message,
message field -> bytes, bytes -> tensor). Here the wire bytes are built with one join
straight from the caller's buffers, and parsed into views of the received bytes.

The encoding is protobuf's own (the .proto stays the contract): fields in number
order, proto3 defaults omitted, exactly what `SerializeToString` produces (tests
compare the two). A decoder meets a message it does not expect (another field order,
unknown fields, ...) and answers None: the caller parses it with protobuf instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from kvcraft.v1 import kvcraft_pb2 as pb

Buffer = Union[bytes, bytearray, memoryview]

_VARINT, _LEN = 0, 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, pos
        shift += 7


def _len_field(field: int, data: Buffer) -> list[Buffer]:
    n = memoryview(data).nbytes
    return [_tag(field, _LEN), _varint(n), data] if n else []


def _uint_field(field: int, n: int) -> bytes:
    return _tag(field, _VARINT) + _varint(n) if n else b""


def _fields(data: Buffer) -> dict[int, int | memoryview] | None:
    """field number -> value (int, or a view of the bytes); None if a field repeats, is
    out of order, or has a wire type other than varint / length-delimited."""
    buf = memoryview(data).cast("B")
    out: dict[int, int | memoryview] = {}
    pos, last = 0, 0
    try:
        while pos < len(buf):
            key, pos = _read_varint(buf, pos)
            field, wt = key >> 3, key & 7
            if field <= last:
                return None
            last = field
            if wt == _VARINT:
                out[field], pos = _read_varint(buf, pos)
            elif wt == _LEN:
                n, pos = _read_varint(buf, pos)
                if pos + n > len(buf):
                    return None
                out[field] = buf[pos : pos + n]
                pos += n
            else:
                return None
    except ValueError:
        return None
    return out


# -- Store: StoreRequest{layer: LayerPayload{layer = 1, key = 2, value = 3}} ----------------
def encode_store_layer(layer: int, key: Buffer, value: Buffer) -> bytes:
    """`StoreRequest(layer=LayerPayload(layer, key, value)).SerializeToString()`, with
    one copy of K and V (the join)."""
    payload = [_uint_field(1, layer), *_len_field(2, key), *_len_field(3, value)]
    size = sum(memoryview(p).nbytes for p in payload)
    return b"".join([_tag(2, _LEN), _varint(size), *payload])


@dataclass(frozen=True, slots=True)
class StoreLayer:
    """A decoded StoreRequest layer: views of the received message's bytes."""

    layer: int
    key: memoryview
    value: memoryview


def decode_store_layer(data: Buffer) -> StoreLayer | None:
    """A StoreRequest that carries a layer, as views; None for anything else."""
    top = _fields(data)
    if top is None or set(top) != {2} or not isinstance(top[2], memoryview):
        return None
    inner = _fields(top[2])
    if inner is None or not set(inner) <= {1, 2, 3}:
        return None
    layer, key, value = inner.get(1, 0), inner.get(2, memoryview(b"")), inner.get(3, memoryview(b""))
    if not isinstance(layer, int) or not isinstance(key, memoryview) or not isinstance(value, memoryview):
        return None
    return StoreLayer(layer, key, value)


# -- FetchLayers: LayerChunk{layer 1, index 2, variant_id 3, key_spec 4, value_spec 5, key 6, value 7}
def layer_chunk_head(layer: int, index: int, variant_id: str, key_spec: bytes, value_spec: bytes) -> bytes:
    """Fields 1-5 of a LayerChunk (the specs already serialized: one per variant)."""
    return b"".join([_uint_field(1, layer), _uint_field(2, index), *_len_field(3, variant_id.encode()),
                     _tag(4, _LEN), _varint(len(key_spec)), key_spec,  # messages: present even if empty
                     _tag(5, _LEN), _varint(len(value_spec)), value_spec])


def encode_layer_chunk(head: bytes, key: Buffer, value: Buffer) -> bytes:
    """`LayerChunk(...).SerializeToString()` from its head and K, V (one copy of each)."""
    return b"".join([head, *_len_field(6, key), *_len_field(7, value)])


@dataclass(frozen=True, slots=True)
class LayerChunkView:
    """A decoded LayerChunk: K and V as views of the received bytes. When those were a
    bytes object, `message` is it and `key_offset` / `value_offset` say where K and V
    start in it. The specs are shared between messages that carry the same spec bytes:
    read them, do not modify them."""

    layer: int
    index: int
    variant_id: str
    key_spec: pb.TensorSpec
    value_spec: pb.TensorSpec
    key: memoryview
    value: memoryview
    message: bytes | None = None
    key_offset: int = 0
    value_offset: int = 0


# The TensorSpecs of recent messages by their bytes: a stream repeats the same few.
_SPECS: dict[bytes, pb.TensorSpec] = {}
_SPECS_MAX = 256


def _spec(raw: bytes) -> pb.TensorSpec:
    spec = _SPECS.get(raw)
    if spec is None:
        spec = pb.TensorSpec.FromString(raw)
        if len(_SPECS) >= _SPECS_MAX:
            _SPECS.clear()
        _SPECS[raw] = spec
    return spec


def decode_layer_chunk(data: Buffer) -> LayerChunkView | None:
    """A LayerChunk with K and V as views of `data`; None if it is not canonical.

    One pass over the field keys (K and V are skipped, not read); a field that repeats,
    comes out of order or has another wire type makes it None (protobuf decides)."""
    buf = data if type(data) is bytes else memoryview(data).cast("B")  # bytes: indexing is cheapest
    end = len(buf)
    pos = last = 0
    ints = [0, 0, 0]  # fields 1, 2 (index 0 unused)
    spans = [(0, 0)] * 8  # fields 3..7: (start, stop)
    try:
        while pos < end:
            key = buf[pos]
            pos += 1
            if key > 0x7F:
                return None  # a field number > 15: not a LayerChunk field
            field, wt = key >> 3, key & 7
            if field <= last or field > 7:
                return None
            last = field
            n = buf[pos]
            pos += 1
            if n > 0x7F:
                n, pos = _read_varint(buf, pos - 1)  # type: ignore[arg-type]
            if field <= 2:
                if wt != _VARINT:
                    return None
                ints[field] = n
            else:
                if wt != _LEN or pos + n > end:
                    return None
                spans[field] = (pos, pos + n)
                pos += n
    except (IndexError, ValueError):  # truncated
        return None
    (vs, ve), (ks0, ks1), (vs0, vs1), (k0, k1), (v0, v1) = spans[3:]
    whole = buf if type(buf) is bytes else None
    view = memoryview(buf) if whole is not None else buf
    try:
        return LayerChunkView(ints[1], ints[2], bytes(buf[vs:ve]).decode(), _spec(bytes(buf[ks0:ks1])),
                              _spec(bytes(buf[vs0:vs1])), view[k0:k1], view[v0:v1], whole, k0, v0)
    except Exception:  # a malformed spec or id: protobuf's parser says what is wrong
        return None
