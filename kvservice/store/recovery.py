"""Recovery, run once when a store opens (docs/storage.md, "Recovery").

Keep exactly the variants whose metadata and full payload agree:
  0. the metadata is read completely, checksums verified, before anything else; if
     it cannot be (a damaged SST, a missing database beside payload files), start-up
     stops with MetadataDamaged naming the damage and `kvcraft repair`: nothing is
     deleted on the word of damaged metadata;
  1. every persistent tier lists its complete payloads (`Tier.scan`), deleting the
     debris of interrupted writes (*.tmp);
  2. a metadata record is kept only if some persistent tier holds its payload with
     the exact size (and, in a tier that does not verify its reads, every layer
     matching its checksum); otherwise the record and the payloads are dropped. The
     disk verifies every read: a payload damaged while the service was down is dropped
     at its first read, never served;
  3. a payload that has no record (a crash between its rename and the metadata
     commit, metadata lost undetected, e.g. a damaged WAL, or an eviction's unlink
     lost by the machine while its unsynced delete was not) is adopted if the record
     it carries (docs/storage.md, "Disk format") matches it and every layer verifies;
     one that cannot be adopted is moved to <data_dir>/lost+found, never deleted;
  4. the index is rebuilt; faster (non-persistent) tiers start empty.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import shutil
from dataclasses import dataclass
from typing import Iterator

from kvservice import variant_codec
from kvservice.index import Variant
from kvservice.metadata import MetadataDamaged
from kvservice.store.state import StoreState
from kvservice.tiers.base import Tier

log = logging.getLogger("kvcraft.store")


@dataclass(frozen=True)
class RecoveryReport:
    variants: int
    dropped_metadata: int  # metadata whose payload was missing, short or corrupt
    orphan_payloads: int  # payload files without metadata that could not be adopted (in lost+found)
    adopted_payloads: int = 0  # payload files without metadata, adopted from their own record


def recover(s: StoreState, *, repair: bool = False) -> RecoveryReport:
    with _collector_paused():  # millions of long-lived objects at 1M variants: scanning them as they come is waste
        return _recover(s, repair)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _recover(s: StoreState, repair: bool) -> RecoveryReport:
    persistent = [t for t in s.tiers if t.persistent]
    records = s.meta.load_variants(s.index)  # complete, or MetadataDamaged before any delete
    access = s.meta.load_access()  # later fr / last access than the records hold
    files = {t.name: dict(t.scan()) for t in persistent}
    if s.meta.created and not repair and any(files.values()):
        n = sum(len(f) for f in files.values())
        s.meta.close()
        shutil.rmtree(s.meta.path)  # the empty database this start made: the next sees the same
        raise MetadataDamaged(s.meta.path, f"the metadata database is missing while {n} payload files exist")
    keep: list[tuple[Variant, list[Tier]]] = []
    drop: list[str] = []
    for vid, v in records:
        # A tier that verifies every read (disk) is not read here: a damaged payload is found,
        # and dropped, at its first read, and a start reads no payload (it took a full read
        # of the disk: minutes on a large one, while engines recompute everything).
        held = [] if v is None else [t for t in persistent if files[t.name].pop(v.variant_id, None) == v.size_bytes
                                     and (t.verify_reads or _payload_ok(t, v))]
        if v is None or not held:
            drop.append(vid)
            for t in persistent:
                files[t.name].pop(vid, None)
                t.delete(vid)
            continue
        keep.append((v, held))
    if drop:
        s.meta.delete_variants(drop, sync=True)
    adopted: list[Variant] = []
    lost = 0
    for t in persistent:
        for vid, size in files[t.name].items():
            v = _adopt(s, t, vid, size)
            if v is not None and all(k.variant_id != vid for k, _ in keep):
                adopted.append(v)
                keep.append((v, [t]))
            else:
                _set_aside(s, t, vid)
                lost += 1
    if adopted:
        s.meta.put_variants(adopted, sync=True)
    for v, _ in keep:
        seen = access.pop(v.variant_id, None)
        if seen is not None:  # both only grow: the larger is the later
            v.fr, v.last_access_ms = max(v.fr, seen[0]), max(v.last_access_ms, seen[1])
    if access:  # of variants no record describes (metadata lost, payload gone)
        s.meta.delete_access(access)
    used = {t.name: 0 for t in persistent}
    for v, held in keep:
        s.retier(v)
        s.index.add(v)
        for t in held:
            used[t.name] += v.size_bytes
    for t in persistent:
        t.reset_usage(used[t.name])
    s.rebuild_eviction_order()
    report = RecoveryReport(len(keep), len(drop), lost, len(adopted))
    if drop or lost or adopted:
        log.warning("recovery: kept %d variants, dropped %d without a valid payload, adopted %d payloads whose "
                    "metadata was missing, moved %d payloads that describe no variant to lost+found",
                    report.variants, report.dropped_metadata, report.adopted_payloads, report.orphan_payloads)
    return report


def _adopt(s: StoreState, tier: Tier, vid: str, size: int) -> Variant | None:
    """The variant a payload file describes, if its record and every layer check out."""
    raw = tier.read_record(vid)
    v = variant_codec.decode(s.index, raw) if raw is not None else None
    if v is None or v.variant_id != vid or size != v.size_bytes or not _payload_ok(tier, v):
        return None
    return v


def _set_aside(s: StoreState, tier: Tier, vid: str) -> None:
    """A payload no record describes: kept for a human in lost+found, not deleted."""
    src = tier.path_of(vid)
    if src is None:
        tier.delete(vid)
        return
    dest = s.cfg.data_path / "lost+found"
    dest.mkdir(exist_ok=True)
    src.rename(dest / src.name)
    tier.delete(vid)  # forget it (the file has moved)


def _payload_ok(tier: Tier, v: Variant) -> bool:
    if len(v.layer_checksums) != v.num_layers:
        return False
    shape = StoreState.shape(v)
    try:
        for layer in range(v.num_layers):
            if not v.layer_intact(layer, tier.get_layer(v.variant_id, layer, shape)):
                return False
    except (KeyError, OSError):
        return False
    return True
