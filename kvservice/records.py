"""Plain records the store takes and returns; `kvservice.wire` converts them to and
from protobuf (the wire stays at the server edge). Those the client shares (`Ref`,
`StoreResult`, `VariantStats`) are the contract's: `kvcraft.records`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from kvcraft.records import VariantStats
from kvservice.index import Spec, Variant


@dataclass(frozen=True)
class StoreHeader:
    """What a Store stream declares before its layers."""

    model_id: str
    token_ids: Sequence[int]
    prefix_keys: Sequence[str]
    num_layers: int
    key_spec: Spec
    value_spec: Spec
    stats: VariantStats = field(default_factory=VariantStats)


@dataclass(frozen=True)
class Selector:
    """Exactly one of chunk_key (every variant of the chunk) or variant_id."""

    chunk_key: str = ""
    variant_id: str = ""


@dataclass(frozen=True)
class Location:
    """Where a leased variant lies in the host slab (length 0: not in host memory) and in
    the gpu pool (gpu_length 0: not in the gpu tier)."""

    variant: Variant
    offset: int
    length: int
    gpu_offset: int = 0
    gpu_length: int = 0


@dataclass(frozen=True)
class GpuPool:
    """The gpu tier's device pool as a same-host engine opens it (docs/gpu.md)."""

    ipc_handle: bytes
    nbytes: int
    device: int


@dataclass(frozen=True)
class Located:
    instance_id: str  # the service run the segment and the gpu pool belong to
    segment: str
    lease_id: str
    expires_s: float
    variants: list[Location]
    gpu: GpuPool | None = None


@dataclass(frozen=True)
class TierStats:
    name: str
    bytes_used: int
    bytes_budget: int
    variants: int
    hits: int
    misses: int
    layer_reads: int = 0  # layers read from the tier: fetches' and copies' (promotion, demotion)


@dataclass(frozen=True)
class StoreStats:
    chunks: int
    variants: int
    tiers: list[TierStats]
    evictions: int
    moves: int
    leases: int
    pinned: int
    inflight_store_bytes: int = 0
    inflight_stores: int = 0
    cluster: ClusterStats | None = None  # a node of a cluster: what it reaches now


@dataclass(frozen=True)
class ClusterStats:
    master_up: bool  # the Mooncake master answers (cluster calls are made)
    silent_segments: tuple[str, ...]  # segments skipped because they stopped answering


@dataclass(frozen=True)
class ChunkSummary:
    chunk_key: str
    model_id: str
    token_count: int
    variants: int
    size_bytes: int
