"""Names of the storage tiers, fastest first.

A tier name is what the wire carries (`VariantInfo.tier`, `LayerChunk` timings,
`TierStats.name`) and what the planner's loading controller keys its profiles by.
The tier objects themselves (budgets, reads, writes) live in the service
(`kvservice.tiers`); a service runs the subset its machine supports.
"""

from __future__ import annotations

GPU = "gpu"  # device memory of the node's GPU (when CUDA is present)
HOST = "host"  # shared-memory slab on the host
DISK = "disk"  # local files (kvikio / POSIX)
REMOTE = "remote"  # a shared store on other nodes

ORDER: tuple[str, ...] = (GPU, HOST, DISK, REMOTE)
"""Every tier name, fastest first."""

