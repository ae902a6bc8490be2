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

Every capability a tier or writer may have is a method or flag below, with a default
that says "not here"; a tier that has it overrides it. The store calls the method and
never asks an object what it is (no getattr, hasattr or isinstance on a tier:
tests/test_tier_contract.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Union

if TYPE_CHECKING:
    from kvservice.cluster.view import ClusterView
    from kvservice.index import Variant
    from kvservice.records import GpuPool

Buffer = Union[bytes, bytearray, memoryview]
Verify = Callable[[int, memoryview], None]  # (layer, K||V bytes); raises if they are wrong
RecordOf = Callable[[str], "Variant | None"]  # the store's record of a variant id


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

    # `read_back` answers: the bytes written so far can be read again before and while
    # `commit` runs (the disk writer: from the page cache or the disk, docs/storage.md "Write order").
    reads_back: bool = False

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

    # -- capabilities: the defaults say "not here" ---------------------------------------
    def describe(self, record: bytes) -> None:
        """The variant's record (`kvservice.variant_codec.encode`), called before `commit`.
        A tier whose payloads describe themselves keeps it beside the layers (disk: after
        them, for recovery and `kvcraft repair`). Default: ignored."""

    def fill_layer(self, read: Callable[[memoryview], None]) -> memoryview | None:
        """Fill the next layer in place: `read(room)` puts its bytes straight into the
        tier's memory (one copy, e.g. a pread from the payload file). Returns the filled
        room (to verify), or None, having done nothing, where the tier's memory is not
        host memory. Default: None (the caller copies with `write_layer`)."""
        return None

    def fill_from(self, source: "Tier", variant_id: str, shape: PayloadShape, verify: Verify | None) -> bool:
        """Copy the whole payload from `source` by a path of this tier's own (the gpu
        tier: the payload file straight into device memory), checking each layer with
        `verify`; only before any layer was written. False, having done nothing, when no
        such path applies. Default: False (the caller copies layer by layer)."""
        return False

    def open_reader(self) -> None:
        """Get ready for `read_back` (the disk writer opens its temporary file before
        `commit` renames it). Default: nothing to do."""

    def read_back(self, offset: int, into: memoryview) -> None:
        """Bytes written so far, from `offset`, straight into `into`, while `commit` may
        run in another thread; only where `reads_back` is set, after `open_reader`. They
        may have been read from the medium: the caller verifies them. Default: raises."""
        raise NotImplementedError(f"{type(self).__name__} does not read back (reads_back is False)")

    def close_reader(self) -> None:
        """Release what `open_reader` took; safe to call without it. Default: nothing."""


class Tier(ABC):
    """One storage tier. Subclasses set the class attributes and implement the methods."""

    name: str  # a kvcraft.tiers name ("gpu", "host", "disk", "remote"); on the wire and in metrics
    persistent: bool = False  # bytes survive a restart of this process: the store recovers from `scan`
    shared: bool = False  # other nodes write and read it too (`cluster_view`): a variant may vanish without this store
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

    # -- capabilities: the defaults say "not here" ---------------------------------------
    def read_layer_into(self, variant_id: str, layer: int, shape: PayloadShape, into: memoryview) -> None:
        """K then V bytes of one layer straight into `into` (`shape.layer_bytes` bytes),
        as `get_layer` raises. A tier that reads its medium (disk) reads into `into` with
        no copy between; the default copies from `get_layer`."""
        into.cast("B")[:] = self.get_layer(variant_id, layer, shape).cast("B")

    def path_of(self, variant_id: str) -> Path | None:
        """The file holding the payload, where the tier keeps one file per variant
        (disk: a GPU-direct read, lost+found at recovery). Default: None."""
        return None

    def read_record(self, variant_id: str) -> bytes | None:
        """The record the payload carries (`TierWriter.describe`), or None if it carries
        none or is absent. Default: None."""
        return None

    def ipc_pool(self) -> "GpuPool | None":
        """The device memory pool a same-host engine opens once by CUDA IPC (the gpu
        tier, docs/gpu.md). Default: None."""
        return None

    def pool_location(self, variant_id: str) -> tuple[int, int] | None:
        """(offset, length) of the payload in `ipc_pool()`; None when absent. Default: None."""
        return None

    def cluster_view(self) -> "ClusterView | None":
        """The variant lists of the cluster a `shared` tier belongs to: the store adopts
        what other nodes stored through it (store/sync.py). Default: None."""
        return None

    def bind(self, record_of: RecordOf) -> None:
        """The store's record of a variant id, for a tier that writes it beside the
        payload itself (the remote object's header). Default: not needed."""

    def adopt(self, variant_id: str, size_bytes: int) -> None:
        """A variant another node stored (listed in `cluster_view()`), of `size_bytes`
        payload bytes, is readable here from now on. Shared tiers only; default: raises."""
        raise NotImplementedError(f"the {self.name} tier is not shared across nodes")

    def close(self) -> None:
        """Release memory and handles at shutdown."""
