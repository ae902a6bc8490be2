"""A Store's commit, and the write order (the one place it is spelled out; docs/storage.md):

  1. each layer, as it arrives, is checked against the header and written to the home
     tier's writer (a temporary file) only (`kvservice.store.session`): an open stream
     holds about the layer in hand in memory (`max_inflight_store_bytes` counts it at
     INFLIGHT_LAYERS layers);
  2. the home writer commits: fsync, rename into place, fsync the directory. Meanwhile
     another thread fills the copy of every cache tier above home that stores new
     variants (the host slab) and admits this one: each layer read back from the file
     (page cache or disk) straight into the copy's room and checked against the
     checksum of the layer as it arrived (a mismatch: the file is deleted, the Store
     fails);
  3. one synced RocksDB WriteBatch with the variant's metadata (group-committed with
     other Stores', `MetadataDB`);
  4. the copies are published, the index and listeners learn of the variant; only
     then is the write acknowledged.
A co-located Store (StoreLocal) follows the same order; each layer is copied once from
the client's staging area (kvservice.store.staging) into the session's own buffer
instead of arriving in a gRPC message, and everything after (checksum, payload file,
host copy read back from the file) comes from that copy.
Deletes go metadata first, then payloads (`Placement.delete_many`). A metadata batch that
fails (a full disk) deletes the Store's payload file: nothing of it stays.
So after a crash at any point, recovery finds a complete variant or debris it deletes.
"""

from __future__ import annotations

import logging
import threading
from array import array
from typing import Protocol

from kvservice import failpoints, variant_codec
from kvservice.errors import Unavailable
from kvservice.index import Variant, eviction_key
from kvcraft.layout import LayerLayout, layer_checksum
from kvcraft.records import StoreResult
from kvservice.records import StoreHeader
from kvservice.store.placement import Placement
from kvservice.store.state import StoreState
from kvservice.tiers.base import TierWriter

# A payload at least this big gets its cache copies filled by another thread while the
# commit fsyncs it; a smaller one after the fsync, in the committing thread (starting a
# thread would cost more than the overlap saves).
FILL_THREAD_BYTES = 1 << 20
log = logging.getLogger("kvcraft.store")


class Arrived(Protocol):
    """What a commit reads of a Store whose layers all arrived (`StoreSession`)."""

    header: StoreHeader
    chunk_key: str
    variant_id: str
    layout: LayerLayout
    home: TierWriter | None  # the home tier's writer, every layer written
    checksums: array  # of each layer as it arrived
    total_bytes: int


def commit(s: StoreState, placement: Placement, session: Arrived) -> StoreResult | None:
    """Steps 2-4 of the write order, for a session whose layers all arrived; None if a
    concurrent identical Store committed the variant first.

    The fsyncs and the synced batch run outside the store lock, so fetches,
    lookups and other stores go on meanwhile (bench/service/load.py); an identical store
    committing at the same time is waited for (both would rename onto one file).
    The cache tiers' copies are read back from the payload file in another thread
    while this one waits for the file's fsync."""
    h = session.header
    now = s.now_ms()
    idx = s.index
    if not _claim_commit(s, session.variant_id):  # a concurrent identical store won
        return None
    copies: list[TierWriter] = []
    try:
        with s.lock:
            v = Variant.build(
                session.variant_id, idx.intern_key(session.chunk_key),
                tuple(idx.intern_key(k) for k in h.prefix_keys), len(h.token_ids), s.tiers[s.home].name,
                h.stats, model_id=h.model_id, num_layers=h.num_layers,
                key_spec=idx.intern_spec(h.key_spec), value_spec=idx.intern_spec(h.value_spec),
                layout=idx.intern_layout(session.layout), layer_checksums=session.checksums,
                last_access_ms=now, created_ms=now)
            _open_copies(s, placement, v, copies)
        home = session.home
        assert home is not None
        home.describe(variant_codec.encode(v))  # self-describing payload: `kvcraft repair` reads it
        failpoints.reach("store:payload-written")
        filler = _Filler(session, copies) if copies else None
        try:
            home.commit()
        finally:
            filled = filler.join() if filler is not None else []
        failpoints.reach("store:payload-committed")
        if filler is not None and filler.error is not None:
            # The file does not read back as the layers that arrived: never acknowledge it.
            with s.lock:
                s.tiers[s.home].delete(session.variant_id)
            raise Unavailable(f"{filler.error}; retry the Store (if it repeats, check the disk)")
        try:
            s.meta.put_variants([v], sync=True)
        except BaseException:
            # Not recorded (a full disk): the payload goes too, so the variant is
            # neither half stored now nor adopted from its file at the next start.
            with s.lock:
                s.tiers[s.home].delete(session.variant_id)
            raise
        failpoints.reach("store:metadata-committed")
        with s.lock:
            for w in filled:
                w.commit()
            s.retier(v)
            idx.add(v)
            s.placed(v)
            for lst in s.listeners:
                lst.on_put(v)
    finally:
        with s.lock:
            for w in copies:
                w.abort()  # no-op for the committed ones
            s.committing.pop(session.variant_id).set()
    return StoreResult(v.chunk_key, v.variant_id, v.size_bytes)


def _claim_commit(s: StoreState, vid: str) -> bool:
    """Make the caller the one session that commits `vid`; False once it is stored."""
    while True:
        with s.lock:
            if vid in s.index:
                return False
            other = s.committing.get(vid)
            if other is None:
                s.committing[vid] = threading.Event()
                return True
        other.wait()


def _open_copies(s: StoreState, placement: Placement, v: Variant, into: list[TierWriter]) -> None:
    """Writers on every cache tier above home that stores new variants and admits
    this one (`Placement.open_cache_writer`; store lock held), appended to `into`
    as they open (the caller aborts them on any failure)."""
    for i in range(s.home):
        if s.tiers[i].cache_on_store:
            w = placement.open_cache_writer(i, v.variant_id, s.shape(v), eviction_key(v), False)
            if w is not None:
                into.append(w)


class _Filler(threading.Thread):
    """Fills a committing Store's cache-tier copies from its payload file while the
    committing thread waits for the file's fsync: each layer is read straight into the
    copy's room (page cache -> slab, one copy; `SlabWriter.fill_layer`) and checked
    against the checksum of the layer as it arrived: a page evicted meanwhile comes
    back from the disk, by the read itself or by the kernel's readahead for an earlier
    one, so a page found in the cache is not proof of the bytes written. `error` is
    set (OSError) if the file does not read back as it was written; a copy that cannot
    be filled in place is left out (aborted by the session)."""

    def __init__(self, session: Arrived, copies: list[TierWriter]) -> None:
        super().__init__(name="kvcraft-store-fill", daemon=True)
        self._session = session
        self._copies = copies
        self.filled: list[TierWriter] = []
        self.error: OSError | None = None
        if session.home.reads_back:  # here, before the commit renames the file
            session.home.open_reader()
        self._background = session.total_bytes >= FILL_THREAD_BYTES
        if self._background:
            self.start()

    def run(self) -> None:
        sess = self._session
        home, layout = sess.home, sess.layout
        try:
            for w in self._copies if home.reads_back else ():
                for layer, expected in enumerate(sess.checksums):
                    room = w.fill_layer(lambda into, off=layer * layout.layer_bytes: home.read_back(off, into))
                    if room is None:
                        break
                    if layer_checksum(room[:layout.key_bytes], room[layout.key_bytes:]) != expected:
                        raise OSError(f"variant {sess.variant_id}: layer {layer} of its payload file does not "
                                      "read back as it arrived (disk or memory fault); not stored")
                else:
                    self.filled.append(w)
        except OSError as e:
            self.error = e.with_traceback(None)  # its frames would keep views of the slab alive
        except Exception:  # a bug: the Store still commits, without the copy
            log.exception("filling the cache copies of variant %s failed", sess.variant_id)
        finally:
            home.close_reader()

    def join(self, timeout: float | None = None) -> list[TierWriter]:  # type: ignore[override]
        if self._background:
            super().join(timeout)
        else:  # a small payload: filled here, after the commit's fsync
            self.run()
        return self.filled
