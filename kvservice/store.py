"""The chunk-cache store: variants, tiers, fr-score eviction, leases, pins, recovery.

Plain Python, no gRPC: the server is a thin adapter around a `ChunkStore`.

Write order (the one place it is spelled out; docs/storage.md):
  1. payload streamed to a temporary file on the disk tier,
  2. fsync, rename into place, fsync the directory,
  3. one synced RocksDB WriteBatch with the variant's metadata,
  4. only then the write is acknowledged (and a copy put in the host tier).
Deletes go the other way: metadata first (synced), then payload. So after a crash
at any point, `_recover` finds either a complete variant or debris it can delete.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol, Sequence

from kvclient.keys import chunk_key, is_key, variant_id
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.config import Config
from kvservice import failpoints
from kvservice.errors import InvalidArgument, NotFound, ResourceExhausted
from kvservice.eviction import eviction_key
from kvservice.planner.variants import fr_increment
from kvservice.layout import LayerLayout, layer_checksum, layer_layout
from kvservice.metadata import MetadataDB
from kvservice.tiers.disk import DiskTier, DiskWriter
from kvservice.tiers.host import HostTier, segment_name

log = logging.getLogger("kvcraft.store")


class StoreListener(Protocol):
    """Told of every change in what is stored (the planner keeps its indexes by it)."""

    def on_put(self, info: pb.VariantInfo) -> None: ...
    def on_move(self, variant_id: str, tier: str) -> None: ...
    def on_evict(self, variant_id: str) -> None: ...


@dataclass
class _Variant:
    info: pb.VariantInfo  # the persisted record; fr and last access change in place
    layout: LayerLayout
    holds: int = 0  # fetch streams and leases holding it now

    @property
    def protected(self) -> bool:
        return self.holds > 0 or self.info.pinned


@dataclass
class _Lease:
    variant_ids: list[str]
    expires: float  # clock() seconds


@dataclass(frozen=True)
class RecoveryReport:
    variants: int
    dropped_metadata: int  # metadata whose payload was missing, short or corrupt
    orphan_payloads: int  # payload files without metadata


@dataclass
class Counters:
    evictions: int = 0
    moves: int = 0
    hits: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    misses: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    corrupt: int = 0


class ChunkStore:
    def __init__(self, cfg: Config, *, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self._clock = clock
        root = cfg.data_path
        root.mkdir(parents=True, exist_ok=True)
        self.meta = MetadataDB(root / "metadata")
        self.disk = DiskTier(root / "payloads", cfg.disk_budget_bytes)
        self.host = HostTier(cfg.host_budget_bytes, segment_name(root))
        self.counters = Counters()
        self.listeners: list[StoreListener] = []
        self._lock = threading.RLock()
        self._variants: dict[str, _Variant] = {}
        self._chunks: dict[str, list[str]] = {}  # chunk key -> variant ids
        self._leases: dict[str, _Lease] = {}
        self._disk_reserved = 0
        self.recovery = self._recover()

    def close(self) -> None:
        with self._lock:
            self._persist_access(self._variants.values())
            self.meta.close()
            self.host.close()

    # -- store ----------------------------------------------------------------------
    def begin_store(self, header: pb.StoreHeader) -> "StoreSession":
        """Validate a Store header and make room on disk; the session takes the layers."""
        cfg = self.cfg
        if not header.model_id:
            raise InvalidArgument("header.model_id is empty")
        if not is_key(header.model_id):
            raise InvalidArgument(
                f"header.model_id {header.model_id[:40]!r} is not 32 lowercase hex chars "
                "(use kvclient.keys.ModelSpec.fingerprint())"
            )
        tokens = len(header.token_ids)
        if tokens == 0:
            raise InvalidArgument("header.token_ids is empty: a chunk has at least one token")
        if tokens > cfg.max_chunk_tokens:
            raise ResourceExhausted(f"chunk has {tokens} tokens; max_chunk_tokens is {cfg.max_chunk_tokens}")
        if not 1 <= header.num_layers <= cfg.max_layers:
            raise InvalidArgument(f"header.num_layers is {header.num_layers}; expected 1..{cfg.max_layers}")
        for i, p in enumerate(header.prefix_keys):
            if not is_key(p):
                raise InvalidArgument(f"header.prefix_keys[{i}] {p[:40]!r} is not a chunk key")
        layout = layer_layout(header.key_spec, header.value_spec, tokens)
        stats = header.stats
        if len(stats.prefix_attention) not in (0, len(header.prefix_keys)):
            raise InvalidArgument(
                f"stats.prefix_attention has {len(stats.prefix_attention)} values for "
                f"{len(header.prefix_keys)} prefix keys"
            )
        if len(stats.token_inter_attention) not in (0, tokens):
            raise InvalidArgument(
                f"stats.token_inter_attention has {len(stats.token_inter_attention)} values "
                f"for {tokens} tokens"
            )
        total = header.num_layers * layout.layer_bytes
        if total > cfg.max_variant_bytes:
            raise ResourceExhausted(f"variant payload is {total} bytes; max_variant_bytes is {cfg.max_variant_bytes}")
        key = chunk_key(header.model_id, header.token_ids)
        vid = variant_id(key, header.prefix_keys)
        with self._lock:
            if vid in self._variants:
                return StoreSession(self, header, key, vid, layout, writer=None)
            self._make_room_for_variant(key)
            self._reserve_disk(total)
        try:
            writer = self.disk.writer(vid)
        except BaseException:
            with self._lock:
                self._disk_reserved -= total
            raise
        return StoreSession(self, header, key, vid, layout, writer=writer)

    def _commit(self, session: "StoreSession", payload: bytes | None) -> pb.StoreResponse:
        """Steps 2-4 of the write order, for a session whose layers all arrived."""
        h = session.header
        now_ms = int(self._clock() * 1000)
        info = pb.VariantInfo(
            variant_id=session.variant_id,
            chunk_key=session.chunk_key,
            model_id=h.model_id,
            prefix_keys=h.prefix_keys,
            token_count=len(h.token_ids),
            num_layers=h.num_layers,
            key_spec=h.key_spec,
            value_spec=h.value_spec,
            stats=h.stats,
            tier="disk",
            size_bytes=session.total_bytes,
            fr=0.0,
            last_access_unix_ms=now_ms,
            created_unix_ms=now_ms,
            layer_checksums=session.checksums,
        )
        assert session.writer is not None
        try:
            with self._lock:
                if session.variant_id in self._variants:  # a concurrent identical store won
                    session.writer.abort()
                    return self._already_present(session)
                failpoints.reach("store:payload-written")
                session.writer.commit()
                failpoints.reach("store:payload-committed")
                self.meta.put_variants([info], sync=True)
                failpoints.reach("store:metadata-committed")
                v = _Variant(info, session.layout)
                self._variants[info.variant_id] = v
                self._chunks.setdefault(info.chunk_key, []).append(info.variant_id)
                if payload is not None and self._admit_host(v, payload):
                    info.tier = "host"
                for lst in self.listeners:
                    lst.on_put(info)
        finally:
            with self._lock:
                self._disk_reserved -= session.total_bytes
        return pb.StoreResponse(
            chunk_key=info.chunk_key, variant_id=info.variant_id, bytes_stored=info.size_bytes
        )

    def _already_present(self, session: "StoreSession") -> pb.StoreResponse:
        v = self._variants[session.variant_id]
        return pb.StoreResponse(
            chunk_key=session.chunk_key,
            variant_id=session.variant_id,
            bytes_stored=v.info.size_bytes,
            already_present=True,
        )

    def _abort(self, session: "StoreSession") -> None:
        if session.writer is not None:
            session.writer.abort()
            with self._lock:
                self._disk_reserved -= session.total_bytes

    # -- fetch ----------------------------------------------------------------------
    def open_fetch(self, refs: Sequence[pb.VariantRef]) -> list[pb.VariantInfo]:
        """Resolve and hold the variants of a fetch; count the reuse (fr += 1/CFO)."""
        variants = self._resolve(refs)
        with self._lock:
            for v in variants:
                v.holds += 1
            self._count_reuse(refs, variants)
        return [v.info for v in variants]

    def _count_reuse(self, refs: Sequence[pb.VariantRef], variants: Sequence[_Variant]) -> None:
        now_ms = int(self._clock() * 1000)
        for ref, v in zip(refs, variants):
            v.info.fr += fr_increment(ref.cfo) if ref.HasField("cfo") else 1.0
            v.info.last_access_unix_ms = now_ms
        self._persist_access(variants)

    def locate(self, refs: Sequence[pb.VariantRef], ttl_s: float = 0.0) -> pb.LocateResponse:
        """Lease the variants, bring them into the host slab, say where they are."""
        lease_id, vids, expires = self.take_lease(refs, ttl_s)
        with self._lock:
            self._count_reuse(refs, [self._variants[v] for v in vids])
        self.promote(vids)
        out = pb.LocateResponse(segment=self.host.segment, lease_id=lease_id, lease_expires_unix_ms=int(expires * 1000))
        with self._lock:
            for vid in vids:
                info = self._variants[vid].info  # leased: still stored
                off, n = self.host.location(vid) if vid in self.host else (0, 0)
                out.variants.add(variant_id=vid, offset=off, length=n, num_layers=info.num_layers,
                                 key_spec=info.key_spec, value_spec=info.value_spec)
        return out

    def close_fetch(self, infos: Iterable[pb.VariantInfo], *, promote: bool = True) -> None:
        """End a fetch's hold; copy variants read from disk up into the host tier."""
        with self._lock:
            for info in infos:
                v = self._variants.get(info.variant_id)
                if v is not None:
                    v.holds -= 1
        if promote:
            self.promote([i.variant_id for i in infos])

    def promote(self, variant_ids: Iterable[str]) -> None:
        """Copy disk-only variants into the host tier (reads verified), then enforce
        the host budget: the fastest tier gets what requests are about to use."""
        todo = []
        with self._lock:
            for vid in variant_ids:
                v = self._variants.get(vid)
                if v is not None and vid not in self.host and v.info.size_bytes <= self.host.budget_bytes:
                    v.holds += 1  # hold while reading, outside the lock
                    todo.append(v)
        for v in todo:
            try:
                payload = self._read_verified(v, 0, v.info.num_layers)
            except NotFound:
                continue
            finally:
                with self._lock:
                    v.holds -= 1
            with self._lock:
                if v.info.variant_id in self._variants and v.info.variant_id not in self.host:
                    if self._admit_host(v, payload):
                        self._set_tier(v, "host")

    def read_layer(self, info: pb.VariantInfo, layer: int) -> tuple[memoryview, memoryview]:
        """K and V bytes of one layer of a held variant; verified if read from disk."""
        vid = info.variant_id
        with self._lock:
            v = self._variants.get(vid)
            if v is None:
                raise NotFound(f"variant {vid} is no longer stored (dropped while fetching); recompute it")
            layout = v.layout
            in_host = vid in self.host
        kb = layout.key_bytes
        if in_host:
            self.counters.hits["host"] += 1
            data = self.host.read(vid, layout.offset(layer), layout.layer_bytes)
        else:
            self.counters.misses["host"] += 1
            self.counters.hits["disk"] += 1
            data = self._read_verified(v, layer, 1)
        return data[:kb], data[kb:]

    def _read_verified(self, v: _Variant, first: int, count: int) -> memoryview:
        """Layers [first, first+count) from disk, each checked against its checksum.

        A failed check drops the whole variant (metadata, then payload) and raises
        NotFound: a corrupt byte is never served; the engine recomputes.
        """
        layout, vid = v.layout, v.info.variant_id
        try:
            data = self.disk.read(vid, layout.offset(first), count * layout.layer_bytes)
        except (KeyError, OSError) as e:
            self._drop(vid, f"payload unreadable: {e}")
            raise NotFound(f"variant {vid}: payload unreadable, dropped; recompute it") from None
        lb, kb = layout.layer_bytes, layout.key_bytes
        for i in range(count):
            chunk = data[i * lb : (i + 1) * lb]
            if layer_checksum(chunk[:kb], chunk[kb:]) != v.info.layer_checksums[first + i]:
                self.counters.corrupt += 1
                self._drop(vid, f"layer {first + i} failed its checksum")
                raise NotFound(
                    f"variant {vid} layer {first + i} failed its checksum; the variant was dropped, recompute it"
                )
        return data

    def _resolve(self, refs: Sequence[pb.VariantRef]) -> list[_Variant]:
        if not refs:
            raise InvalidArgument("variants is empty: name at least one chunk")
        if len(refs) > self.cfg.max_fetch_variants:
            raise ResourceExhausted(f"{len(refs)} variants requested; max_fetch_variants is {self.cfg.max_fetch_variants}")
        out = []
        with self._lock:
            for i, ref in enumerate(refs):
                if not is_key(ref.chunk_key):
                    raise InvalidArgument(f"variants[{i}].chunk_key {ref.chunk_key[:40]!r} is not a chunk key")
                if not 0 <= ref.cfo <= 1:
                    raise InvalidArgument(f"variants[{i}].cfo is {ref.cfo}; expected [0, 1], or unset if unknown")
                vids = self._chunks.get(ref.chunk_key)
                if not vids:
                    raise NotFound(f"chunk {ref.chunk_key} is not stored")
                if ref.variant_id:
                    if ref.variant_id not in vids:
                        raise NotFound(f"chunk {ref.chunk_key} has no variant {ref.variant_id}")
                    out.append(self._variants[ref.variant_id])
                else:
                    out.append(self._default_variant(vids))
        return out

    def _default_variant(self, vids: list[str]) -> _Variant:
        vs = [self._variants[v] for v in vids]
        alone = [v for v in vs if not v.info.prefix_keys]
        return alone[0] if alone else max(vs, key=lambda v: eviction_key(v.info))

    # -- leases and pins --------------------------------------------------------------
    def take_lease(self, refs: Sequence[pb.VariantRef], ttl_s: float = 0.0) -> tuple[str, list[str], float]:
        if ttl_s < 0:
            raise InvalidArgument(f"ttl_s is {ttl_s}; expected >= 0")
        variants = self._resolve(refs)
        ttl = ttl_s or self.cfg.lease_timeout_s
        with self._lock:
            self._expire_leases()
            lease_id = secrets.token_hex(16)
            expires = self._clock() + ttl
            self._leases[lease_id] = _Lease([v.info.variant_id for v in variants], expires)
            for v in variants:
                v.holds += 1
        return lease_id, [v.info.variant_id for v in variants], expires

    def release(self, lease_id: str) -> bool:
        with self._lock:
            self._expire_leases()
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            self._unhold(lease.variant_ids)
            return True

    def _expire_leases(self) -> None:
        now = self._clock()
        for lid in [lid for lid, l in self._leases.items() if l.expires <= now]:
            self._unhold(self._leases.pop(lid).variant_ids)

    def _unhold(self, vids: Iterable[str]) -> None:
        for vid in vids:
            v = self._variants.get(vid)
            if v is not None:
                v.holds -= 1

    def set_pinned(self, selector: pb.VariantSelector, pinned: bool) -> int:
        with self._lock:
            vs = self._select(selector)
            for v in vs:
                v.info.pinned = pinned
            self.meta.put_variants([v.info for v in vs], sync=True)
            return len(vs)

    def _select(self, selector: pb.VariantSelector) -> list[_Variant]:
        which = selector.WhichOneof("target")
        if which == "chunk_key":
            vids = self._chunks.get(selector.chunk_key)
            if not vids:
                raise NotFound(f"chunk {selector.chunk_key} is not stored")
            return [self._variants[v] for v in vids]
        if which == "variant_id":
            v = self._variants.get(selector.variant_id)
            if v is None:
                raise NotFound(f"variant {selector.variant_id} is not stored")
            return [v]
        raise InvalidArgument("selector is empty: give chunk_key or variant_id")

    # -- eviction ---------------------------------------------------------------------
    def evict(self, selector: pb.VariantSelector) -> tuple[int, int]:
        with self._lock:
            self._expire_leases()
            return self._evict_many(self._select(selector))

    def flush(self) -> tuple[int, int]:
        with self._lock:
            self._expire_leases()
            return self._evict_many(list(self._variants.values()))

    def _evict_many(self, vs: list[_Variant]) -> tuple[int, int]:
        victims = [v for v in vs if not v.protected]
        for v in victims:
            self._delete(v.info.variant_id)
        self.counters.evictions += len(victims)
        return len(victims), len(vs) - len(victims)

    def _victims(self, pool: Iterable[_Variant]) -> list[_Variant]:
        return sorted((v for v in pool if not v.protected), key=lambda v: eviction_key(v.info))

    def _reserve_disk(self, nbytes: int) -> None:
        """Make `nbytes` fit in the disk budget by deleting lowest-fr variants, or refuse."""
        budget = self.disk.budget_bytes
        if self.disk.usage() + self._disk_reserved + nbytes > budget:
            self._expire_leases()
            for v in self._victims(self._variants.values()):
                if self.disk.usage() + self._disk_reserved + nbytes <= budget:
                    break
                self._delete(v.info.variant_id)
                self.counters.evictions += 1
        if self.disk.usage() + self._disk_reserved + nbytes > budget:
            raise ResourceExhausted(
                f"disk tier is full: budget {budget} bytes, {self.disk.usage()} used, "
                f"{self._disk_reserved} reserved, {nbytes} requested, and every stored "
                "variant is leased or pinned"
            )
        self._disk_reserved += nbytes

    def _make_room_for_variant(self, key: str) -> None:
        """Cache-Craft §3.3: at most M variants per chunk and N x M variants in all."""
        cfg = self.cfg
        mine = [self._variants[v] for v in self._chunks.get(key, ())]
        if len(mine) >= cfg.max_variants_per_chunk:
            self._expire_leases()
            victims = self._victims(mine)
            if not victims:
                raise ResourceExhausted(
                    f"chunk {key} already holds {len(mine)} variants (max_variants_per_chunk) "
                    "and all are leased or pinned"
                )
            self._delete(victims[0].info.variant_id)
            self.counters.evictions += 1
        if len(self._variants) >= cfg.max_variants:
            self._expire_leases()
            victims = self._victims(self._variants.values())
            if not victims:
                raise ResourceExhausted(f"store holds max_variants={cfg.max_variants} variants, all leased or pinned")
            self._delete(victims[0].info.variant_id)
            self.counters.evictions += 1

    def _admit_host(self, v: _Variant, payload: bytes | memoryview) -> bool:
        """Cache-Craft §3.3 for the host tier: a copy goes in only if, among the host's
        unprotected copies and the newcomer, it is not the lowest fr; lower ones are
        moved one tier down (their copy dropped) until the slab has room."""
        if v.info.size_bytes > self.host.budget_bytes:
            return False
        self._expire_leases()
        while not self.host.put(v.info.variant_id, payload):
            in_host = [x for x in self._variants.values() if x.info.variant_id in self.host]
            victims = self._victims(in_host)
            if not victims:
                return False
            if not v.protected and eviction_key(v.info) < eviction_key(victims[0].info):
                self.counters.moves += 1  # the newcomer is the one that goes down
                return False
            self.host.delete(victims[0].info.variant_id)
            self._set_tier(victims[0], "disk")
            self.counters.moves += 1
        return True

    def _set_tier(self, v: _Variant, tier: str) -> None:
        v.info.tier = tier
        for lst in self.listeners:
            lst.on_move(v.info.variant_id, tier)

    def _delete(self, vid: str) -> None:
        """Metadata first (synced), then payloads: a crash leaves only an orphan file."""
        self.meta.delete_variants([vid])
        failpoints.reach("delete:metadata-committed")
        v = self._variants.pop(vid)
        vids = self._chunks[v.info.chunk_key]
        vids.remove(vid)
        if not vids:
            del self._chunks[v.info.chunk_key]
        self.host.delete(vid)
        self.disk.delete(vid)
        for lst in self.listeners:
            lst.on_evict(vid)

    def _drop(self, vid: str, why: str) -> None:
        with self._lock:
            if vid in self._variants:
                log.warning("dropping variant %s: %s", vid, why)
                self._delete(vid)

    def _persist_access(self, vs: Iterable[_Variant]) -> None:
        infos = [v.info for v in vs]
        if infos:
            self.meta.put_variants(infos, sync=False)

    # -- queries ----------------------------------------------------------------------
    def lookup(self, key: str) -> list[pb.VariantInfo]:
        with self._lock:
            vs = [self._variants[v] for v in self._chunks.get(key, ())]
            return [self._public(v) for v in sorted(vs, key=lambda v: eviction_key(v.info), reverse=True)]

    def _public(self, v: _Variant) -> pb.VariantInfo:
        out = pb.VariantInfo()
        out.CopyFrom(v.info)
        out.leased = any(v.info.variant_id in l.variant_ids for l in self._leases.values())
        return out

    def match_prefix(self, variant_ids: Sequence[str]) -> int:
        """How many leading ids of the chain are stored."""
        with self._lock:
            n = 0
            for vid in variant_ids:
                if vid not in self._variants:
                    break
                n += 1
            return n

    def all_variants(self) -> list[pb.VariantInfo]:
        with self._lock:
            return [self._public(v) for v in self._variants.values()]

    def variant_count(self) -> int:
        return len(self._variants)

    def stats(self) -> pb.StatsResponse:
        with self._lock:
            self._expire_leases()
            host_n = sum(1 for vid in self._variants if vid in self.host)
            c = self.counters
            return pb.StatsResponse(
                chunks=len(self._chunks),
                variants=len(self._variants),
                tiers=[
                    pb.TierStats(name="host", bytes_used=self.host.usage(), bytes_budget=self.host.budget_bytes,
                                 variants=host_n, hits=c.hits["host"], misses=c.misses["host"]),
                    pb.TierStats(name="disk", bytes_used=self.disk.usage(), bytes_budget=self.disk.budget_bytes,
                                 variants=len(self._variants), hits=c.hits["disk"], misses=c.misses["disk"]),
                ],
                evictions=c.evictions,
                moves=c.moves,
                leases=len(self._leases),
                pinned=sum(1 for v in self._variants.values() if v.info.pinned),
            )

    def list_chunks(self, model_id: str, page_size: int, page_token: str) -> pb.ListChunksResponse:
        page_size = page_size or 100
        if page_size > 1000:
            raise InvalidArgument(f"page_size is {page_size}; at most 1000")
        with self._lock:
            keys = sorted(k for k in self._chunks if k > page_token)
            out = []
            for k in keys:
                vs = [self._variants[v].info for v in self._chunks[k]]
                if model_id and vs[0].model_id != model_id:
                    continue
                out.append(pb.ChunkSummary(chunk_key=k, model_id=vs[0].model_id, token_count=vs[0].token_count,
                                           variants=len(vs), size_bytes=sum(i.size_bytes for i in vs)))
                if len(out) == page_size:
                    break
            more = bool(out) and out[-1].chunk_key != (keys[-1] if keys else "")
            return pb.ListChunksResponse(chunks=out, next_page_token=out[-1].chunk_key if more else "")

    def get_chunk(self, key: str) -> list[pb.VariantInfo]:
        found = self.lookup(key)
        if not found:
            raise NotFound(f"chunk {key} is not stored")
        return found

    # -- recovery ---------------------------------------------------------------------
    def _recover(self) -> RecoveryReport:
        """Keep exactly the variants whose metadata and full, verified payload agree."""
        files = dict(self.disk.scan())  # also deletes .tmp debris of interrupted writes
        keep, drop = [], []
        for info in self.meta.load_variants():
            size = files.pop(info.variant_id, None)
            try:
                layout = layer_layout(info.key_spec, info.value_spec, info.token_count)
            except InvalidArgument:
                drop.append(info.variant_id)
                continue
            v = _Variant(info, layout)
            if size != info.num_layers * layout.layer_bytes or not self._payload_ok(v):
                drop.append(info.variant_id)
                self.disk.path_of(info.variant_id).unlink(missing_ok=True)
                continue
            info.tier = "disk"
            keep.append(v)
        if drop:
            self.meta.delete_variants(drop)
        for vid in files:
            self.disk.path_of(vid).unlink(missing_ok=True)
        for v in keep:
            self._variants[v.info.variant_id] = v
            self._chunks.setdefault(v.info.chunk_key, []).append(v.info.variant_id)
        self.disk.reset_usage(sum(v.info.size_bytes for v in keep))
        report = RecoveryReport(len(keep), len(drop), len(files))
        if drop or files:
            log.warning("recovery: kept %d variants, dropped %d without a valid payload, deleted %d orphan payloads",
                        *(report.variants, report.dropped_metadata, report.orphan_payloads))
        return report

    def _payload_ok(self, v: _Variant) -> bool:
        layout, vid = v.layout, v.info.variant_id
        if len(v.info.layer_checksums) != v.info.num_layers:
            return False
        kb = layout.key_bytes
        for layer in range(v.info.num_layers):
            data = self.disk.read(vid, layout.offset(layer), layout.layer_bytes)
            if layer_checksum(data[:kb], data[kb:]) != v.info.layer_checksums[layer]:
                return False
        return True


class StoreSession:
    """One Store stream: validates each layer as it arrives and streams it to disk."""

    def __init__(self, store: ChunkStore, header: pb.StoreHeader, key: str, vid: str,
                 layout: LayerLayout, writer: DiskWriter | None) -> None:
        self._store = store
        self.header = header
        self.chunk_key = key
        self.variant_id = vid
        self.layout = layout
        self.writer = writer
        self.total_bytes = header.num_layers * layout.layer_bytes
        self.checksums: list[int] = []
        keep_copy = writer is not None and self.total_bytes <= store.host.budget_bytes
        self._host_copy: bytearray | None = bytearray() if keep_copy else None
        self._done = False
        # A cancelled stream's abort may arrive while a worker thread writes a layer.
        self._lock = threading.Lock()

    def add_layer(self, layer: pb.LayerPayload) -> None:
        with self._lock:
            if self._done:
                raise InvalidArgument("the Store stream was aborted")
            self._add_layer(layer)

    def _add_layer(self, layer: pb.LayerPayload) -> None:
        n = len(self.checksums)
        if n >= self.header.num_layers:
            raise InvalidArgument(f"layer {layer.layer} is past header.num_layers={self.header.num_layers}")
        if layer.layer != n:
            raise InvalidArgument(f"expected layer {n}, got layer {layer.layer}: layers must arrive in order")
        if len(layer.key) != self.layout.key_bytes:
            raise InvalidArgument(
                f"layer {n}: key has {len(layer.key)} bytes; key_spec needs {self.layout.key_bytes}")
        if len(layer.value) != self.layout.value_bytes:
            raise InvalidArgument(
                f"layer {n}: value has {len(layer.value)} bytes; value_spec needs {self.layout.value_bytes}")
        self.checksums.append(layer_checksum(layer.key, layer.value))
        if self.writer is not None:
            self.writer.write(layer.key)
            self.writer.write(layer.value)
            if self._host_copy is not None:
                self._host_copy += layer.key
                self._host_copy += layer.value

    def finish(self) -> pb.StoreResponse:
        with self._lock:
            if self._done:
                raise InvalidArgument("the Store stream was aborted")
            return self._finish()

    def _finish(self) -> pb.StoreResponse:
        if len(self.checksums) != self.header.num_layers:
            raise InvalidArgument(
                f"stream ended after {len(self.checksums)} of header.num_layers={self.header.num_layers} layers")
        self._done = True
        if self.writer is None:
            with self._store._lock:
                if self.variant_id in self._store._variants:
                    return self._store._already_present(self)
            raise NotFound(f"variant {self.variant_id} was evicted while being stored again; store it once more")
        payload = bytes(self._host_copy) if self._host_copy is not None else None
        return self._store._commit(self, payload)

    def abort(self) -> None:
        with self._lock:
            if not self._done:
                self._done = True
                self._store._abort(self)
