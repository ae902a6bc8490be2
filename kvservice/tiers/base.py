"""The tier contract: where a variant's payload bytes live, and how they get there.

A store runs an ordered list of tiers, fastest first (`kvservice.tiers.build_tiers`):
gpu (when CUDA is present), host, disk, remote (when configured). Every tier speaks
this one protocol; the store never names a tier, it walks the list:

- home tier: the first `persistent` tier (disk). A Store is acknowledged only after
  the home tier's writer committed (and the metadata batch after it).
- a Store also writes every tier above the home tier whose `cache_on_store` is set
  (host), each layer once, from the same buffer, while the stream arrives.
- demotion (Cache-Craft §3.3): when tier i needs room, its lowest-fr unprotected
  variant moves one tier down: copied into tier i+1 if no lower tier holds it yet
  (layer by layer, `get_layer` -> `open_writer`), then deleted from tier i. Leaving
  the last tier deletes the variant (payloads first, then metadata).
- promotion: a variant is copied up into a faster tier from the fastest tier below
  it that holds it, layer by layer, verified when the source has `verify_reads`.
- reads: from the fastest tier holding the variant.

Tiers above the home tier hold copies (inclusive). A tier knows nothing of fr,
leases or metadata; the store decides what goes where. Methods may be called from
several threads, but never twice at once for the same variant id (the store's holds
guarantee that).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator, Union

Buffer = Union[bytes, bytearray, memoryview]


@dataclass(frozen=True, slots=True)
class PayloadShape:
    """How a payload divides into layers: `num_layers` runs of `layer_bytes` bytes
    (K then V of one layer, docs/storage.md). All a tier needs to know of a payload."""

    num_layers: int
    layer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def offset(self, layer: int) -> int:
        return layer * self.layer_bytes


@dataclass(frozen=True, slots=True)
class SharedLocation:
    """Where a same-host process finds a payload: shared-memory segment, byte range."""

    segment: str
    offset: int
    length: int


class TierFull(Exception):
    """The tier cannot take this many bytes now; the store makes room and retries, or
    (above the home tier) keeps the variant out of this tier."""


class TierWriter(ABC):
    """Streams one variant's payload, layer by layer in order, into one tier."""

    @abstractmethod
    def write_layer(self, *parts: Buffer) -> None:
        """Append the next layer: the bytes of `parts` back to back (K then V; no join
        copy needed). Keeps no reference to `parts` after returning."""

    @abstractmethod
    def commit(self) -> None:
        """Every layer was written: make the payload readable, and durable before
        returning when the tier is `persistent` (fsync, rename, fsync the directory).
        From now on the tier holds the variant and counts it in `usage()`."""

    @abstractmethod
    def abort(self) -> None:
        """Drop what was written and free the room reserved; safe to call twice and
        after `commit` (then it does nothing)."""


class Tier(ABC):
    """One storage tier. Subclasses set the class attributes and implement the methods."""

    name: str  # a kvcraft.tiers name ("gpu", "host", "disk", "remote"); on the wire and in metrics
    persistent: bool = False  # bytes survive a restart of this process: the store recovers from `scan`
    shared: bool = False  # other nodes write and read it too: a variant may vanish without this store
    cache_on_store: bool = False  # a Store writes a copy here too (tiers above the home tier only)
    verify_reads: bool = False  # the store checks layer checksums on every read from this tier
    mappable: bool = False  # `mapping()` answers: same-host processes map its memory (Locate)
    segment: str = ""  # a mappable tier's shared-memory segment name

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes

    @abstractmethod
    def open_writer(self, variant_id: str, shape: PayloadShape) -> TierWriter:
        """Start writing a payload of `shape`; reserves its room until commit or abort.
        Raises TierFull when the room is not free now (over budget, or no contiguous
        run in a slab); OSError when the medium fails."""

    @abstractmethod
    def get_layer(self, variant_id: str, layer: int, shape: PayloadShape) -> memoryview:
        """K then V bytes of one layer. KeyError if the tier does not hold the variant,
        OSError on I/O failure. No checksum check here: the store verifies. A memory
        tier may return a view of its own memory, valid while the store holds the variant."""

    def get_layers(self, variant_id: str, first: int, count: int, shape: PayloadShape) -> memoryview:
        """Layers [first, first + count) back to back (one read where the tier can)."""
        out = bytearray(count * shape.layer_bytes)
        for i in range(count):
            out[i * shape.layer_bytes : (i + 1) * shape.layer_bytes] = self.get_layer(variant_id, first + i, shape)
        return memoryview(out)

    @abstractmethod
    def delete(self, variant_id: str) -> None:
        """Drop the payload; absent is not an error."""

    @abstractmethod
    def usage(self) -> int:
        """Payload bytes held now (committed writes), as counted against `budget_bytes`."""

    @abstractmethod
    def __contains__(self, variant_id: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int:
        """Variants the tier holds a committed copy of (O(1): the store's stats read it
        on every metrics scrape)."""

    @abstractmethod
    def variant_ids(self) -> list[str]:
        """The ids of the variants it holds a committed copy of, a snapshot (the store
        rebuilds the tier's eviction order from it)."""

    def scan(self) -> Iterator[tuple[str, int]]:
        """(variant id, payload bytes) of every complete payload held, deleting the
        debris of interrupted writes. Persistent tiers only; run once, at start-up."""
        return iter(())

    def reset_usage(self, used: int) -> None:
        """Recovery kept payloads of `used` bytes in all (persistent tiers only)."""

    def mapping(self, variant_id: str) -> SharedLocation | None:
        """Where a same-host process can map the payload (the host slab), or None."""
        return None

    def close(self) -> None:
        """Release memory and handles at shutdown."""
