"""Protobuf <-> the service's plain records, in one place: the server edge. A variant's
record message is `kvservice.variant_codec`'s (the stored format: RocksDB values and the
record a payload file carries), used here as it is."""

from __future__ import annotations

from typing import Sequence

from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.fidelity import Choice, Tally
from kvservice.index import Spec
from kvcraft.records import Ref, StoreResult
from kvservice.records import ChunkSummary, Located, Selector, StoreHeader, StoreStats
from kvservice.variant_codec import spec_message, stats_record, variant_message

__all__ = ["list_chunks_response", "locate_response", "refs", "selector", "spec", "spec_message", "stats_record",
           "stats_response", "store_header", "store_response", "variant_message"]


def spec(msg: pb.TensorSpec) -> Spec:
    return Spec(msg.dtype, tuple(msg.shape))


def store_header(h: pb.StoreHeader) -> StoreHeader:
    return StoreHeader(h.model_id, h.token_ids, tuple(h.prefix_keys), h.num_layers, spec(h.key_spec),
                       spec(h.value_spec), stats_record(h.stats))


def store_response(r: StoreResult) -> pb.StoreResponse:
    return pb.StoreResponse(chunk_key=r.chunk_key, variant_id=r.variant_id, bytes_stored=r.bytes_stored,
                            already_present=r.already_present)


def refs(msgs: Sequence[pb.VariantRef]) -> list[Ref]:
    return [Ref(m.chunk_key, m.variant_id, m.cfo if m.HasField("cfo") else None) for m in msgs]


def selector(msg: pb.VariantSelector) -> Selector:
    which = msg.WhichOneof("target")
    if which == "chunk_key":
        return Selector(chunk_key=msg.chunk_key)
    if which == "variant_id":
        return Selector(variant_id=msg.variant_id)
    return Selector()


def locate_response(r: Located) -> pb.LocateResponse:
    out = pb.LocateResponse(instance_id=r.instance_id, segment=r.segment, lease_id=r.lease_id, lease_expires_unix_ms=int(r.expires_s * 1000))
    if r.gpu is not None:
        out.gpu_ipc_handle, out.gpu_pool_bytes, out.gpu_device = r.gpu.ipc_handle, r.gpu.nbytes, r.gpu.device
    for loc in r.variants:
        v = loc.variant
        out.variants.add(variant_id=v.variant_id, offset=loc.offset, length=loc.length, num_layers=v.num_layers,
                         key_spec=spec_message(v.key_spec), value_spec=spec_message(v.value_spec),
                         gpu_offset=loc.gpu_offset, gpu_length=loc.gpu_length)
    return out


def stats_response(s: StoreStats, fidelity: Sequence[Tally] = (), budgets: Sequence[Choice] = (),
                   target: float = 0.0) -> pb.StatsResponse:
    out = pb.StatsResponse(
        chunks=s.chunks, variants=s.variants, evictions=s.evictions, moves=s.moves, leases=s.leases, pinned=s.pinned,
        inflight_store_bytes=s.inflight_store_bytes, inflight_stores=s.inflight_stores,
        tiers=[pb.TierStats(name=t.name, bytes_used=t.bytes_used, bytes_budget=t.bytes_budget, variants=t.variants,
                            hits=t.hits, misses=t.misses) for t in s.tiers])
    for t in fidelity:
        lower, upper = t.interval
        out.fidelity.add(model_id=t.model_id, policy=t.policy, samples=t.samples, top1_agree=t.top1_agree,
                         agree_lower=lower, agree_upper=upper, mean_kl=t.mean_kl,
                         mean_computed_share=t.mean_computed_share, budget=t.budget,
                         answer_tokens=t.answer_tokens, answer_agree=t.answer_agree, shadow_blends=t.shadow_blends)
    for c in budgets:
        out.budgets.add(model_id=c.model_id, policy=c.policy, budget=c.budget, state=c.state, below=c.below,
                        near_tie=c.near_tie)
    out.fidelity_target = target
    if s.cluster is not None:
        out.cluster.master_up = s.cluster.master_up
        out.cluster.silent_segments.extend(s.cluster.silent_segments)
    return out


def list_chunks_response(chunks: list[ChunkSummary], next_token: str) -> pb.ListChunksResponse:
    return pb.ListChunksResponse(
        chunks=[pb.ChunkSummary(chunk_key=c.chunk_key, model_id=c.model_id, token_count=c.token_count,
                                variants=c.variants, size_bytes=c.size_bytes) for c in chunks],
        next_page_token=next_token)
