"""The client's records and wire messages: requests built from Python values, answers
turned back into records and tensors. Pure functions of the contract
(proto/kvcraft/v1/kvcraft.proto); no channel, no blocking, no asyncio.

The records the service shares (`Ref`, `StoreResult`, `VariantStats`, and a Plan's
answer, `Plan`) are the contract's (`kvcraft.records`, `kvcraft.plans`), free of
protobuf: they are converted here, at the client's edge."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence, TypeVar, Union

import torch

from kvclient.tensors import byte_view, from_message, message_tensors, spec_of, to_bytes
from kvcraft import codec
from kvcraft.plans import ChunkPlan, KeyChain, Plan, Source
from kvcraft.records import Ref, StoreResult, VariantStats
from kvcraft.v1 import kvcraft_pb2 as pb

Layer = tuple[torch.Tensor, torch.Tensor]  # (K, V), each [kv_heads, tokens, head_dim]


RefLike = Union[str, Ref]
ChunkLike = Union[Sequence[int], tuple[str, int]]  # token ids, or (chunk key, token count)
M = TypeVar("M")  # a protobuf message


@dataclass(frozen=True)
class FetchedLayer:
    layer: int
    index: int  # position of the variant in the request
    variant_id: str
    key: torch.Tensor
    value: torch.Tensor


@dataclass(frozen=True)
class Lease:
    lease_id: str
    variant_ids: list[str]
    expires_unix_ms: int

    @classmethod
    def of(cls, r: pb.LeaseResponse) -> "Lease":
        return cls(r.lease_id, list(r.variant_ids), r.expires_unix_ms)


def _with_token_ids(make: Callable[[Sequence[int]], M], token_ids: Sequence[int]) -> M:
    """make(ids) with the ids as given: protobuf reads a list of ints in one C pass (512
    ids: 25 µs, against 91 µs when each is converted with int() first). Ids it refuses
    but int() takes (floats, numeric strings) are then converted one by one, so callers
    may pass either."""
    try:
        return make(token_ids)
    except TypeError:
        return make([int(t) for t in token_ids])


def _check_count(name: str, value: int) -> None:
    """A uint32 field's value, refused by name (protobuf's own error names neither)."""
    if not 0 <= value < 1 << 32:
        raise ValueError(f"{name} is {value}; expected 0 .. 2**32 - 1")


# -- Store ------------------------------------------------------------------------------
def store_header(model_id: str, token_ids: Sequence[int], layers: Sequence[Layer],
                 prefix_keys: Sequence[str] = (), stats: VariantStats | None = None) -> pb.StoreHeader:
    """The Store's header; ValueError, before anything is sent, for layers that are no variant's
    (none, or one that is not a storable [kv_heads, tokens, head_dim] tensor) or a token id
    outside uint32. (That each layer matches the first, the service checks and names.)"""
    if not layers:
        raise ValueError("layers is empty: a variant has at least one layer")
    for i, (k, v) in enumerate(layers):
        try:
            spec_of(k), spec_of(v)
        except ValueError as e:
            raise ValueError(f"layers[{i}]: {e}") from None
    k0, v0 = layers[0]
    try:
        header = _with_token_ids(lambda ids: pb.StoreHeader(model_id=model_id, token_ids=ids,
                                                            prefix_keys=list(prefix_keys), num_layers=len(layers),
                                                            key_spec=spec_of(k0), value_spec=spec_of(v0)), token_ids)
    except ValueError as e:  # protobuf's "Value out of range: -1"
        raise ValueError(f"token_ids: {e} (a token id is a uint32)") from None
    if stats is not None:
        header.stats.CopyFrom(pb.VariantStats(a=stats.a, b=stats.b, prefix_attention=stats.prefix_attention,
                                              token_inter_attention=stats.token_inter_attention,
                                              recompute_scores=stats.recompute_scores))
    return header


def store_requests(model_id: str, token_ids: Sequence[int], layers: Sequence[Layer],
                   prefix_keys: Sequence[str] = (), stats: VariantStats | None = None) -> Iterator[pb.StoreRequest]:
    """The Store stream as protobuf messages (the reference for `store_messages`)."""
    yield pb.StoreRequest(header=store_header(model_id, token_ids, layers, prefix_keys, stats))
    for i, (k, v) in enumerate(layers):
        yield pb.StoreRequest(layer=pb.LayerPayload(layer=i, key=to_bytes(k), value=to_bytes(v)))


def store_messages(model_id: str, token_ids: Sequence[int], layers: Sequence[Layer],
                   prefix_keys: Sequence[str] = (), stats: VariantStats | None = None) -> Iterator[bytes]:
    """The Store stream serialized: the header through protobuf, each layer by
    `kvcraft.codec` straight from the tensors' memory (one copy of its bytes; the same
    wire bytes as `store_requests`). The arguments are checked here, before the stream
    starts (`store_header`): a ValueError raised while grpc iterates the stream would reach
    the caller only as UNKNOWN "Exception iterating requests!"."""
    header = pb.StoreRequest(header=store_header(model_id, token_ids, layers, prefix_keys, stats))
    return _store_stream(header.SerializeToString(), layers)


def _store_stream(header: bytes, layers: Sequence[Layer]) -> Iterator[bytes]:
    yield header
    for i, (k, v) in enumerate(layers):
        yield codec.encode_store_layer(i, byte_view(k), byte_view(v))


def store_result_of(r: pb.StoreResponse, local: bool = False) -> StoreResult:
    """local: the layers went through shared memory (StoreLocal)."""
    return StoreResult(r.chunk_key, r.variant_id, r.bytes_stored, r.already_present, local=local)


# -- FetchLayers ------------------------------------------------------------------------
def fetch_request(refs: Sequence[RefLike], first_layer: int = 0, num_layers: int = 0) -> pb.FetchRequest:
    _check_count("first_layer", first_layer)
    _check_count("num_layers", num_layers)
    return pb.FetchRequest(variants=[variant_ref(r) for r in refs], first_layer=first_layer, num_layers=num_layers)


def layer_chunk(data: bytes) -> codec.LayerChunkView | pb.LayerChunk:
    """FetchLayers responses: K and V as views of the received bytes (no copy)."""
    return codec.decode_layer_chunk(data) or pb.LayerChunk.FromString(data)


def fetched_layer(msg: codec.LayerChunkView | pb.LayerChunk, device: str | torch.device) -> FetchedLayer:
    """K and V as tensors over the received message's bytes (no copy; see from_message)."""
    if isinstance(msg, codec.LayerChunkView) and msg.message is not None:
        k, v = message_tensors(msg.message, ((msg.key_spec, msg.key_offset, msg.key.nbytes),
                                             (msg.value_spec, msg.value_offset, msg.value.nbytes)), device)
        return FetchedLayer(msg.layer, msg.index, msg.variant_id, k, v)
    return FetchedLayer(msg.layer, msg.index, msg.variant_id,
                        from_message(msg.key_spec, msg.key, device), from_message(msg.value_spec, msg.value, device))


# -- Plan, Lookup, leases, Admin --------------------------------------------------------
def plan_request(model_id: str, chunks: Sequence[ChunkLike], question_tokens: int, conversation_id: str = "",
                 first_turn: bool | None = None, lease_ttl_s: float = 0.0,
                 timings: pb.TimingReport | None = None, policy: str = "", adaptive: bool = False) -> pb.PlanRequest:
    _check_count("question_tokens", question_tokens)
    req = pb.PlanRequest(model_id=model_id, conversation_id=conversation_id, question_tokens=question_tokens,
                         lease_ttl_s=lease_ttl_s, timings=timings, policy=policy, adaptive=adaptive)
    for c in chunks:
        if isinstance(c, tuple) and len(c) == 2 and isinstance(c[0], str):
            req.chunks.add(chunk_key=c[0], token_count=c[1])
        else:
            _with_token_ids(lambda ids: req.chunks.add(token_ids=ids), c)
    if first_turn is not None:
        req.first_turn = first_turn
    return req


_SOURCES = tuple(Source)  # indexed by the wire's number


def plan_of(r: pb.PlanResponse) -> Plan:
    """The PlanResponse as a Plan record, every field (a number this client does not know
    as a ChunkPlan source reads as Source.UNSPECIFIED)."""
    n = len(_SOURCES)
    return Plan(
        order=tuple(r.order), dropped=tuple(r.dropped), history=tuple(r.history),
        chunks=tuple(ChunkPlan(c.chunk_key, c.position, c.token_start, c.token_count,
                               _SOURCES[c.source] if 0 <= c.source < n else Source.UNSPECIFIED, c.variant_id, c.tier,
                               c.cfo, tuple(c.recompute), c.variant_prefix_chain, c.variant_prefix_length)
                     for c in r.chunks),
        ratio=r.ratio, preload_depth=r.preload_depth, load_s_per_layer=r.load_s_per_layer,
        compute_s_per_layer=r.compute_s_per_layer, lease_id=r.lease_id,
        lease_expires_unix_ms=r.lease_expires_unix_ms, computed_tokens=r.computed_tokens,
        other_keys=tuple(r.other_keys), variant_prefixes=tuple(KeyChain(tuple(c.ranges)) for c in r.variant_prefixes),
        recompute_budget=round(r.recompute_budget, 6), fidelity_sample=r.fidelity_sample,  # float32 on the wire
        fidelity_below=round(r.fidelity_below, 6), no_reuse=r.no_reuse, near_tie=round(r.near_tie, 6))


def variant_ref(r: RefLike) -> pb.VariantRef:
    r = Ref(r) if isinstance(r, str) else r
    return pb.VariantRef(chunk_key=r.chunk_key, variant_id=r.variant_id, cfo=r.cfo)  # None leaves it unset


def lookup_request(model_id: str | None, token_ids: Sequence[int] | None, chunk_key: str | None) -> pb.LookupRequest:
    if chunk_key:
        return pb.LookupRequest(chunk_key=chunk_key)
    if model_id is None or token_ids is None:
        raise ValueError("give chunk_key, or model_id and token_ids")
    return pb.LookupRequest(tokens=_with_token_ids(lambda ids: pb.ChunkTokens(model_id=model_id, token_ids=ids),
                                                   token_ids))


def selector(chunk_key: str | None, variant_id: str | None) -> pb.VariantSelector:
    if bool(chunk_key) == bool(variant_id):
        raise ValueError("give exactly one of chunk_key or variant_id")
    return pb.VariantSelector(chunk_key=chunk_key) if chunk_key else pb.VariantSelector(variant_id=variant_id)
