"""Plain records shared by the client, the service and the engine adapter (no torch, no
protobuf: the conversions live at the edges, kvclient.messages and kvservice.wire)."""

from __future__ import annotations

from dataclasses import dataclass, field


# slots: one record per stored variant (a million in a large index), so no per-instance
# __dict__, which a large index would pay for in resident memory.
@dataclass(frozen=True, slots=True)
class VariantStats:
    """Attention statistics of one variant, measured when its KV was computed.

    Cache-Craft §3.1 (eq. 3-4, 9-10): for chunk C_i computed behind prefix chunks
    C_1..C_{i-1}, with attention weights averaged over heads:
      a                     = (1/L) sum_l sum_{j<i} inter_l(C_i, C_j) / |C_i|   (eq. 9-10)
      b                     = (1/L) sum_l intra_l(C_i) / |C_i|                   (eq. 9-10)
      prefix_attention[j]   = (1/L) sum_l inter_l(C_i, C_j) / |C_i|, one per prefix chunk,
                              in prefix order (beta, eq. 6, needs inter per prefix chunk)
      token_inter_attention = per token t of C_i: sum_l sum_{j<i} inter_l(t, C_j)
                              (top-N token selection, eq. 14)
      recompute_scores      = per token, the learned recompute score
                              (`engine_adapter.learned.learn`); when present
                              it ranks the tokens instead of token_inter_attention
    A chunk computed alone (empty prefix) has a = 0 and empty prefix_attention.
    """

    a: float = 0.0
    b: float = 0.0
    prefix_attention: tuple[float, ...] = field(default_factory=tuple)
    token_inter_attention: tuple[float, ...] = field(default_factory=tuple)
    recompute_scores: tuple[float, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class Ref:
    """A variant to fetch or lease (kvcraft.v1.VariantRef). Empty variant_id: the service
    picks the chunk's variant computed alone, else its variant with the highest fr.
    cfo: the Cache-Craft CFO of this reuse (ChunkPlan.cfo, in [0, 1]); the variant's fr
    grows by 1/max(cfo, 0.01). None: unknown, counted as cfo = 1 (fr += 1)."""

    chunk_key: str
    variant_id: str = ""
    cfo: float | None = None


@dataclass(frozen=True)
class StoreResult:
    """What a Store did (kvcraft.v1.StoreResponse). already_present: an identical variant
    was stored before and is kept as it was. local: the client sent the layers through
    shared memory (StoreLocal), not the gRPC byte stream; the service's own results
    leave it False."""

    chunk_key: str
    variant_id: str
    bytes_stored: int
    already_present: bool = False
    local: bool = False
