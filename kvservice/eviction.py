"""Which variant goes first when a tier is over budget (Cache-Craft §3.3).

Cache-Craft keeps the variants that are reused most and fixed cheapest: each reuse
adds 1/CFO to a variant's frequency-reuse score fr, and eviction takes the lowest fr.
Ties go to the least recently accessed, then the oldest, then the variant id, so the
order is total and a brute-force model can reproduce it exactly.
"""

from __future__ import annotations

from kvcraft.v1 import kvcraft_pb2 as pb


def eviction_key(info: pb.VariantInfo) -> tuple[float, int, int, str]:
    return (info.fr, info.last_access_unix_ms, info.created_unix_ms, info.variant_id)

