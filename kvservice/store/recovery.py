"""Recovery, run once when a store opens (docs/storage.md, "Recovery").

Keep exactly the variants whose metadata and full, verified payload agree:
  1. every persistent tier lists its complete payloads (`Tier.scan`), deleting the
     debris of interrupted writes (*.tmp);
  2. a metadata record is kept only if some persistent tier holds its payload with
     the exact size and every layer matching its checksum; otherwise the record and
     the payloads are dropped;
  3. payloads that have no record are deleted (a crash between a rename and the
     metadata commit, or between a metadata delete and the payload delete);
  4. the index is rebuilt; faster (non-persistent) tiers start empty.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass

from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.errors import InvalidArgument
from kvservice.index import InvalidVariant, Spec, Variant
from kvcraft.layout import layer_checksum, layer_layout
from kvservice.wire import stats_record
from kvservice.store.state import StoreState
from kvservice.tiers.base import Tier

log = logging.getLogger("kvcraft.store")


@dataclass(frozen=True)
class RecoveryReport:
    variants: int
    dropped_metadata: int  # metadata whose payload was missing, short or corrupt
    orphan_payloads: int  # payload files without metadata


def recover(s: StoreState) -> RecoveryReport:
    persistent = [t for t in s.tiers if t.persistent]
    files = {t.name: dict(t.scan()) for t in persistent}
    keep: list[tuple[Variant, list[Tier]]] = []
    drop: list[str] = []
    for info in s.meta.load_variants():
        v = decode(s, info)
        held = [] if v is None else [t for t in persistent if files[t.name].pop(v.variant_id, None) == v.size_bytes
                                     and _payload_ok(t, v)]
        if v is None or not held:
            drop.append(info.variant_id)
            for t in persistent:
                files[t.name].pop(info.variant_id, None)
                t.delete(info.variant_id)
            continue
        keep.append((v, held))
    if drop:
        s.meta.delete_variants(drop)
    orphans = 0
    for t in persistent:
        for vid in files[t.name]:
            t.delete(vid)
            orphans += 1
    used = {t.name: 0 for t in persistent}
    for v, held in keep:
        v.tier = held[0].name
        s.index.add(v)
        for t in held:
            used[t.name] += v.size_bytes
    for t in persistent:
        t.reset_usage(used[t.name])
    report = RecoveryReport(len(keep), len(drop), orphans)
    if drop or orphans:
        log.warning("recovery: kept %d variants, dropped %d without a valid payload, deleted %d orphan payloads",
                    report.variants, report.dropped_metadata, report.orphan_payloads)
    return report


def decode(s: StoreState, info: pb.VariantInfo) -> Variant | None:
    """The in-memory record of a stored one, or None if it contradicts itself."""
    idx = s.index
    key_spec = idx.intern_spec(Spec(info.key_spec.dtype, tuple(info.key_spec.shape)))
    value_spec = idx.intern_spec(Spec(info.value_spec.dtype, tuple(info.value_spec.shape)))
    try:
        layout = idx.intern_layout(layer_layout(key_spec, value_spec, info.token_count))
        return Variant.build(
            info.variant_id, idx.intern_key(info.chunk_key), tuple(idx.intern_key(k) for k in info.prefix_keys),
            info.token_count, "", stats_record(info.stats), model_id=info.model_id, num_layers=info.num_layers,
            key_spec=key_spec, value_spec=value_spec, layout=layout, layer_checksums=array("Q", info.layer_checksums),
            fr=info.fr, last_access_ms=info.last_access_unix_ms, created_ms=info.created_unix_ms,
            pinned=info.pinned)
    except (InvalidArgument, InvalidVariant, ValueError):
        return None


def _payload_ok(tier: Tier, v: Variant) -> bool:
    if len(v.layer_checksums) != v.num_layers:
        return False
    shape, kb = StoreState.shape(v), v.layout.key_bytes  # type: ignore[union-attr]
    try:
        for layer in range(v.num_layers):
            data = tier.get_layer(v.variant_id, layer, shape)
            if layer_checksum(data[:kb], data[kb:]) != v.layer_checksums[layer]:
                return False
    except (KeyError, OSError):
        return False
    return True
