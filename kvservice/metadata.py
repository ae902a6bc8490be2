"""Variant metadata in RocksDB (through rocksdict; docs/storage.md says why not rocksdb-py).

Column family "variants": variant id (ascii) -> the variant's record as bytes
(`kvservice.variant_codec`: the on-disk format only, records in memory are `index.Variant`).
Column family "access": variant id -> the variant's latest fr and last access (16 bytes,
`ACCESS`), written on every reuse instead of the whole VariantInfo (hundreds of bytes to
kilobytes: its per-token statistics). Both only grow, so recovery takes the larger of
the two records' values. Column family "fidelity": model id (32 ascii chars) ++ policy
(utf-8) ++ NUL ++ recompute budget ("0.1500") -> that sampled-fidelity tally (`FIDELITY`,
`kvservice.fidelity`; a key without the budget: budget 0), written unsynced. Column family
"meta": format version. Writes that make a variant are durable before they return;
deletes need not be (recovery drops a record whose payload is gone, docs/storage.md), and a
variant's delete drops its access record in the same batch; access updates are unsynced
(losing the last few on a crash only makes eviction slightly less informed).

Durable writes are group-committed, off the GIL: rocksdict holds the GIL through a
RocksDB write with sync=True, so a synced write per Store would stop every thread of
the server, the event loop included, for the disk's sync time (docs/benchmarks.md,
load). Instead, the first writer to arrive becomes the leader: it takes every write
waiting, writes them as one WriteBatch without RocksDB's sync, then fsyncs the
write-ahead log files with os.fsync (which releases the GIL); writers that arrive
meanwhile queue for the next group. No write returns before an fsync that began after
it reached the log: the same guarantee as sync=True, one disk sync per group.
"""

from __future__ import annotations

import gc
import logging
import os
import struct
import threading
from pathlib import Path
from typing import Callable, Iterable

from rocksdict import Options, ReadOptions, Rdict, WriteBatch, WriteOptions

from kvservice import variant_codec
from kvservice.datadir import DataDirInUse, holder
from kvservice.errors import disk_full
from kvservice.fidelity import LEAD_EDGES, Tally
from kvservice.index import Variant, VariantIndex

# "access" and "fidelity" came later: a database without them has no such records yet
FORMAT_VERSION = b"1"
_CFS = ("variants", "access", "fidelity", "meta")
_WRITTEN = ("variants", "access", "fidelity")  # the families batches write to
ACCESS = struct.Struct("<dq")  # fr, last access (unix ms)
# samples, top-1 agreements, sum of KL, sum of computed share, answer tokens compared, of
# them agreeing (a record of the first four alone: no answer compared)
LEAD_BINS = len(LEAD_EDGES) + 1
FIDELITY = struct.Struct(f"<QQddQQQ{2 * LEAD_BINS}I")  # ... shadow blends, the leads' bins, the lost ones'
FIDELITY_BLENDS = struct.Struct("<QQddQQQ")  # a record from before the samples' leads were counted
FIDELITY_ANSWERS = struct.Struct("<QQddQQ")  # a record from before shadow blends were counted
FIDELITY_FIRST = struct.Struct("<QQdd")  # from before answers were compared
_FIDELITY_BY_SIZE = {f.size: f for f in (FIDELITY, FIDELITY_BLENDS, FIDELITY_ANSWERS, FIDELITY_FIRST)}
MODEL_ID_CHARS = 32
log = logging.getLogger("kvcraft.metadata")

Ops = Callable[[WriteBatch], None]  # adds one write's puts / deletes to a batch


class _Waiter:
    """One durable write waiting for its group's commit."""

    __slots__ = ("ops", "done", "error")

    def __init__(self, ops: Ops) -> None:
        self.ops = ops
        self.done = False
        self.error: BaseException | None = None


class MetadataDamaged(Exception):
    """The metadata cannot be read completely. Nothing was deleted; the message names
    the damage and the way out (`kvcraft repair`, docs/operations.md)."""

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(
            f"metadata in {path} is damaged: {what}. No payload was deleted. Stop the service and run "
            f"`kvcraft repair --data-dir {path.parent}`: it moves the damaged metadata aside and rebuilds it "
            "from the self-describing payload files (pins, fr scores and fidelity tallies start afresh)")
        self.path = path


class MetadataDiskFull(Exception):
    """RocksDB cannot open the metadata because the disk under it is full: nothing changed."""

    def __init__(self, path: Path, error: BaseException) -> None:
        super().__init__(
            f"the disk under {path.parent} is full: RocksDB cannot open the metadata in {path} ({error}). "
            "Nothing was changed, and the metadata is not damaged (do not run `kvcraft repair`): free space on "
            "that disk and start again")
        self.path = path


def _budget(raw: bytes) -> float:
    """A fidelity key's budget ("0.1500"); 0 where it is missing or not a number in [0, 1]."""
    try:
        b = float(raw.decode("ascii")) if raw else 0.0
    except (UnicodeDecodeError, ValueError):
        return 0.0
    return b if 0.0 <= b <= 1.0 else 0.0


def _nothing(wb: WriteBatch) -> None:
    pass


def _close_quietly(handle: object) -> None:
    try:
        handle.close()  # type: ignore[attr-defined]
    except Exception:  # "Writer has previous error": expected after a failed write
        pass


class MetadataDB:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.created = not (self.path / "CURRENT").exists()  # no database was here before
        try:
            self._open()
        except Exception as e:  # rocksdict raises plain Exception for RocksDB statuses
            if "lock hold by current process" in str(e):
                raise DataDirInUse(self.path.parent, f"this process (pid {os.getpid()}), which has its "
                                   "metadata open already") from None
            if "While lock file" in str(e):  # RocksDB's own lock: held, not damaged
                raise DataDirInUse(self.path.parent, holder(self.path / "LOCK")) from None
            if disk_full(e):  # not damage: `kvcraft repair` would drop pins, scores and tallies for nothing
                raise MetadataDiskFull(self.path, e) from None
            raise MetadataDamaged(self.path, f"RocksDB cannot open it ({e})") from None
        self._generation = 0
        self._closed_by: Exception | None = None  # what left `_db` None (a failed reopen)
        self._reopen_lock = threading.Lock()
        self._group = threading.Condition()  # guards _queue and _leading
        self._queue: list[_Waiter] = []  # durable writes waiting for the next group
        self._leading = False  # a leader is committing a group now
        self._wal: dict[str, int] = {}  # write-ahead log file name -> open fd (for fsync)
        self._sync = WriteOptions()
        self._sync.sync = True
        self._nosync = WriteOptions()
        version = self._meta.get(b"format")
        if version is None:
            self._meta.put(b"format", FORMAT_VERSION, self._sync)
        elif version != FORMAT_VERSION:
            raise RuntimeError(f"{path}: metadata format {version!r}, this build reads {FORMAT_VERSION!r}")

    def _open(self) -> None:
        """Open the database and its column families. All or nothing: a failure (a full
        disk cannot take the new MANIFEST and log a reopen writes) leaves every handle
        None, the state `_write_batch` knows as closed and reopens from."""
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.create_missing_column_families(True)
        opts.set_paranoid_checks(True)
        db = Rdict(str(self.path), opts, column_families={cf: Options(raw_mode=True) for cf in _CFS})
        try:
            cfs = {cf: db.get_column_family(cf) for cf in _CFS}
            # Write handles by column family, looked up when a batch is built (after a
            # reopen, or the access family made anew, they are new ones).
            handles = {cf: db.get_column_family_handle(cf) for cf in _WRITTEN}
        except Exception:
            _close_quietly(db)
            raise
        self._db = db
        self._variants, self._meta, self._access = cfs["variants"], cfs["meta"], cfs["access"]
        self._fidelity = cfs["fidelity"]
        self._handles = handles

    def _write(self, ops: Ops, sync: bool) -> None:
        """One batch of `ops`; with `sync`, durable before returning (group commit)."""
        if sync:
            self._write_durable(ops)
        else:
            self._write_batch([ops])

    def _write_batch(self, group: list[Ops]) -> None:
        """One WriteBatch of every `ops`, without RocksDB's sync; all of it or none.

        After a failed write (a full disk) RocksDB refuses every later one until the
        database is reopened: reopen once and retry, so the service recovers by itself
        when space frees. A reopen that fails too (the disk is still full) leaves the
        database closed (`_db` None), and the next write starts with the reopen. If
        the write still fails, the first error is raised: RocksDB's own status, which
        names the cause ("No space left on device"), mapped to a status code by
        kvservice.server.status."""
        if all(ops is _nothing for ops in group):
            return  # a bare sync: the log's fsync alone makes the earlier writes durable

        def build() -> WriteBatch:
            wb = WriteBatch(raw_mode=True)
            for ops in group:
                ops(wb)
            return wb

        generation, db = self._generation, self._db
        error: Exception | None = None
        if db is not None:
            try:
                db.write(build(), self._nosync)
                return
            except Exception as first:  # rocksdict raises plain Exception for RocksDB statuses
                error = first
        with self._reopen_lock:
            if self._generation == generation:  # no other writer reopened it meanwhile
                self._drop_handles()
                try:
                    self._open()
                except Exception as e:
                    self._closed_by = error or e
                    raise self._closed_by from None
                self._generation += 1
            db = self._db
            if db is None:  # reopened by another writer, then closed again by a third
                raise self._closed_by from None  # type: ignore[misc]
        try:
            db.write(build(), self._nosync)
        except Exception as e:
            raise (error or e) from None

    def _write_durable(self, ops: Ops) -> None:
        """Queue `ops`; the first writer that finds no group committing leads the next:
        one batch of every queued write, one fsync of the log, then all of them return."""
        me = _Waiter(ops)
        with self._group:
            self._queue.append(me)
            while self._leading and not me.done:
                self._group.wait()
            if not me.done:  # lead: take every write queued so far (this one included)
                self._leading = True
                group, self._queue = self._queue, []
        if not me.done:
            error: BaseException | None = None
            try:
                self._write_batch([w.ops for w in group])
                self._sync_wal()
            except BaseException as e:  # every writer of the group gets it
                error = e
            with self._group:
                for w in group:
                    w.done, w.error = True, error
                self._leading = False
                self._group.notify_all()
        if me.error is not None:
            raise me.error

    def _sync_wal(self) -> None:
        """fsync the write-ahead log files (and the directory when a new one appeared).

        A write without RocksDB's sync is in the current log file when it returns
        (RocksDB hands each write to the OS unless manual_wal_flush is set); a log file
        that vanished meanwhile was retired after its contents reached synced table
        files. os.fsync releases the GIL, rocksdict's synced write does not."""
        names = {e.name for e in os.scandir(self.path) if e.name.endswith(".log")}
        for gone in set(self._wal) - names:
            os.close(self._wal.pop(gone))
        new = False
        for name in sorted(names - set(self._wal)):
            try:
                self._wal[name] = os.open(self.path / name, os.O_RDONLY)
            except FileNotFoundError:  # retired between the scan and the open
                continue
            new = True
        for fd in self._wal.values():
            os.fsync(fd)
        if new:  # the new log file's directory entry
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def load_variants(self, index: VariantIndex | None = None) -> list[tuple[str, Variant | None]]:
        """Every stored record, read completely, checksums verified: (variant id, the
        record with its parts interned in `index`, or None where it contradicts itself:
        recovery drops those). Raises MetadataDamaged if any part is unreadable:
        rocksdict's items() stops early at a damaged block without a word, which would
        make the payloads of every record after it look like orphans."""
        idx = index if index is not None else VariantIndex()
        ro = ReadOptions()
        ro.set_verify_checksums(True)
        it = self._variants.iter(ro)
        out = []
        try:
            it.seek_to_first()
            while it.valid():
                try:
                    info = variant_codec.parse(it.value())
                except variant_codec.Undecodable:
                    raise MetadataDamaged(self.path, f"the record of {it.key()[:40]!r} does not parse") from None
                out.append((info.variant_id, variant_codec.to_variant(idx, info)))
                it.next()
            it.status()
        except MetadataDamaged:
            raise
        except Exception as e:  # the iterator's status: Corruption, IOError
            raise MetadataDamaged(self.path, f"{e} (after {len(out)} records)") from None
        finally:
            del it
        return out

    def load_access(self) -> dict[str, tuple[float, int]]:
        """Every access record: variant id -> (fr, last access ms). Hints only: a record
        that does not unpack is skipped, and damage (a table file failing its checksum)
        does not stop the start: the access records are dropped, with a warning, and the
        scores start from the variant records."""
        ro = ReadOptions()
        ro.set_verify_checksums(True)
        it = self._access.iter(ro)
        out: dict[str, tuple[float, int]] = {}
        try:
            it.seek_to_first()
            while it.valid():
                raw = it.value()
                if len(raw) == ACCESS.size:
                    out[it.key().decode("ascii", "replace")] = ACCESS.unpack(raw)
                it.next()
            it.status()
        except Exception as e:  # the iterator's status: Corruption, IOError
            log.warning("access records in %s are damaged after %d (%s): they are dropped, and fr scores "
                        "start from the variant records", self.path, len(out), e)
            del it
            self._reset_access()
            return {}
        del it
        return out

    def load_fidelity(self) -> list[Tally]:
        """Every fidelity tally (`kvservice.fidelity`). Like access records, not worth refusing
        a start for: a record that does not unpack is skipped, damage drops them all (warned)."""
        ro = ReadOptions()
        ro.set_verify_checksums(True)
        it = self._fidelity.iter(ro)
        out: list[Tally] = []
        try:
            it.seek_to_first()
            while it.valid():
                key, raw = it.key(), it.value()
                if len(raw) in _FIDELITY_BY_SIZE and len(key) > MODEL_ID_CHARS:
                    samples, agree, kl, share, *rest = _FIDELITY_BY_SIZE[len(raw)].unpack(raw)
                    rest, bins = rest[:3], rest[3:]
                    leads = tuple(bins[:LEAD_BINS]) if any(bins) else ()
                    policy, _, budget = key[MODEL_ID_CHARS:].partition(b"\0")
                    out.append(Tally(key[:MODEL_ID_CHARS].decode("ascii", "replace"), policy.decode("utf-8", "replace"),
                                     samples, agree, kl, share, _budget(budget), *rest,
                                     leads=leads, lost=tuple(bins[LEAD_BINS:]) if leads else ()))
                it.next()
            it.status()
        except Exception as e:  # the iterator's status: Corruption, IOError
            log.warning("fidelity tallies in %s are damaged (%s): sampled fidelity starts afresh", self.path, e)
            del it
            self._fidelity.close()
            self._fidelity = None
            self._fidelity = self._reset("fidelity")
            return []
        del it
        return out

    def put_fidelity(self, tallies: Iterable[Tally]) -> None:
        """Fidelity tallies, unsynced (a crash loses the last second's samples)."""
        self._put("fidelity", [(f"{t.model_id}{t.policy}\0{t.budget:.4f}".encode(),
                                FIDELITY.pack(t.samples, t.top1_agree, t.kl_sum, t.computed_share_sum,
                                              t.answer_tokens, t.answer_agree, t.shadow_blends,
                                              *(t.leads or (0,) * LEAD_BINS), *(t.lost or (0,) * LEAD_BINS)))
                               for t in tallies], False)

    def _reset_access(self) -> None:
        self._access.close()
        self._access = None
        self._access = self._reset("access")

    def _reset(self, cf: str) -> Rdict:
        """Drop a column family of hints and make it anew: a damaged table file left in
        it would fail a later compaction, and RocksDB then refuses every write."""
        self._handles[cf] = None
        self._db.drop_column_family(cf)
        family = self._db.create_column_family(cf, Options(raw_mode=True))
        self._handles[cf] = self._db.get_column_family_handle(cf)
        return family

    def sync(self) -> None:
        """Make every write that returned before this call durable: one group commit
        (an empty batch and the log's fsync, shared with the synced writes queued
        beside it). A caller that writes with the store's lock held writes unsynced and
        calls this once the lock is free, so Plans and fetches do not wait for the disk."""
        self._write_durable(_nothing)

    def put_variants(self, variants: Iterable[Variant], *, sync: bool) -> None:
        self._put("variants", [(v.variant_id.encode(), variant_codec.encode(v)) for v in variants], sync)

    def put_access(self, variants: Iterable[Variant]) -> None:
        """The variants' fr and last access, unsynced."""
        self._put("access", [(v.variant_id.encode(), ACCESS.pack(v.fr, v.last_access_ms)) for v in variants], False)

    def delete_variants(self, variant_ids: Iterable[str], *, sync: bool) -> None:
        self._delete(("variants", "access"), variant_ids, sync)

    def delete_access(self, variant_ids: Iterable[str]) -> None:
        """Access records of variants no record describes (recovery), unsynced."""
        self._delete(("access",), variant_ids, False)

    def _put(self, cf: str, records: list[tuple[bytes, bytes]], sync: bool) -> None:
        def ops(wb: WriteBatch) -> None:
            handle = self._handles[cf]
            for key, raw in records:
                wb.put(key, raw, handle)

        self._write(ops, sync)

    def _delete(self, cfs: tuple[str, ...], variant_ids: Iterable[str], sync: bool) -> None:
        keys = [vid.encode() for vid in variant_ids]

        def ops(wb: WriteBatch) -> None:
            handles = [self._handles[cf] for cf in cfs]
            for key in keys:
                for handle in handles:
                    wb.delete(key, handle)

        self._write(ops, sync)

    def _drop_handles(self) -> None:
        """Let go of the database: RocksDB's lock is released only once no handle is
        left (close() alone keeps it, and raises on a database in an error state)."""
        for handle in (self._variants, self._access, self._fidelity, self._meta, self._db):
            if handle is not None:
                _close_quietly(handle)
        self._variants = self._access = self._fidelity = self._meta = self._db = None
        self._handles = {}
        gc.collect()

    def close(self) -> None:
        """Flush and close; afterwards the same process can open the database again."""
        for fd in self._wal.values():
            os.close(fd)
        self._wal.clear()
        try:
            for handle in (self._variants, self._access, self._fidelity, self._meta, self._db):
                if handle is not None:
                    handle.close()
        except Exception as e:  # a full disk cannot take the flush at close
            log.warning("metadata in %s not flushed at close (%s): every acknowledged record is in its "
                        "write-ahead log and is replayed at the next start", self.path, e)
        self._drop_handles()
