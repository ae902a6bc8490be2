"""Variant metadata in RocksDB (through rocksdict; docs/storage.md says why not rocksdb-py).

Column family "variants": variant id (ascii) -> serialized kvcraft.v1.VariantInfo (the
protobuf message is the on-disk format only: records in memory are `index.Variant`).
Column family "meta": format version. Writes that make or drop a variant are one
WriteBatch with sync=True; fr / last-access updates are unsynced (losing the last
few on a crash only makes eviction slightly less informed).
"""

from __future__ import annotations

import gc
import logging
import threading
from pathlib import Path
from typing import Callable, Iterable

from google.protobuf.message import DecodeError

from rocksdict import Options, ReadOptions, Rdict, WriteBatch, WriteOptions

from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.index import Variant
from kvservice.wire import variant_message

FORMAT_VERSION = b"1"
_CFS = ("variants", "meta")
log = logging.getLogger("kvcraft.metadata")


class MetadataDamaged(Exception):
    """The metadata cannot be read completely. Nothing was deleted; the message names
    the damage and the way out (`kvcraft repair`, docs/operations.md)."""

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(
            f"metadata in {path} is damaged: {what}. No payload was deleted. Stop the service and run "
            f"`kvcraft repair --data-dir {path.parent}`: it moves the damaged metadata aside and rebuilds it "
            "from the self-describing payload files (pins and fr scores start afresh)")
        self.path = path


class MetadataDB:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.created = not (self.path / "CURRENT").exists()  # no database was here before
        try:
            self._open()
        except Exception as e:  # rocksdict raises plain Exception for RocksDB statuses
            raise MetadataDamaged(self.path, f"RocksDB cannot open it ({e})") from None
        self._generation = 0
        self._reopen_lock = threading.Lock()
        self._sync = WriteOptions()
        self._sync.sync = True
        self._nosync = WriteOptions()
        version = self._meta.get(b"format")
        if version is None:
            self._meta.put(b"format", FORMAT_VERSION, self._sync)
        elif version != FORMAT_VERSION:
            raise RuntimeError(f"{path}: metadata format {version!r}, this build reads {FORMAT_VERSION!r}")

    def _open(self) -> None:
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.create_missing_column_families(True)
        opts.set_paranoid_checks(True)
        self._db = Rdict(str(self.path), opts, column_families={cf: Options(raw_mode=True) for cf in _CFS})
        self._variants = self._db.get_column_family("variants")
        self._meta = self._db.get_column_family("meta")
        self._variants_h = self._db.get_column_family_handle("variants")

    def _write(self, build: Callable[[], WriteBatch], sync: bool) -> None:
        """One batch. After a failed write (a full disk) RocksDB refuses every later one
        until the database is reopened: reopen once and retry, so the service recovers
        by itself when space frees. If it still fails, the first error is raised."""
        opts = self._sync if sync else self._nosync
        generation = self._generation
        try:
            self._db.write(build(), opts)
            return
        except Exception as first:  # rocksdict raises plain Exception for RocksDB statuses
            error = first
        with self._reopen_lock:
            if self._generation == generation:
                try:
                    self._drop_handles()
                    self._open()
                except Exception:
                    raise error from None
                self._generation += 1
        try:
            self._db.write(build(), opts)
        except Exception:
            raise error from None

    def load_variants(self) -> list[pb.VariantInfo]:
        """Every stored record, read completely, checksums verified; recovery validates
        them (`decode`) before use. Raises MetadataDamaged if any part is unreadable:
        rocksdict's items() stops early at a damaged block without a word, which would
        make the payloads of every record after it look like orphans."""
        ro = ReadOptions()
        ro.set_verify_checksums(True)
        it = self._variants.iter(ro)
        out = []
        try:
            it.seek_to_first()
            while it.valid():
                info = pb.VariantInfo()
                try:
                    info.ParseFromString(it.value())
                except DecodeError:
                    raise MetadataDamaged(self.path, f"the record of {it.key()[:40]!r} does not parse") from None
                out.append(info)
                it.next()
            it.status()
        except MetadataDamaged:
            raise
        except Exception as e:  # the iterator's status: Corruption, IOError
            raise MetadataDamaged(self.path, f"{e} (after {len(out)} records)") from None
        finally:
            del it
        return out

    def put_variants(self, variants: Iterable[Variant], *, sync: bool) -> None:
        records = [(v.variant_id.encode(), variant_message(v).SerializeToString()) for v in variants]

        def build() -> WriteBatch:
            wb = WriteBatch(raw_mode=True)
            for key, raw in records:
                wb.put(key, raw, self._variants_h)
            return wb

        self._write(build, sync)

    def delete_variants(self, variant_ids: Iterable[str]) -> None:
        keys = [vid.encode() for vid in variant_ids]

        def build() -> WriteBatch:
            wb = WriteBatch(raw_mode=True)
            for key in keys:
                wb.delete(key, self._variants_h)
            return wb

        self._write(build, True)

    def _drop_handles(self) -> None:
        """Let go of a database in an error state: its close() raises, and RocksDB's
        lock is released only once no handle is left."""
        for handle in (self._variants, self._meta, self._db):
            try:
                handle.close()
            except Exception:  # "Writer has previous error": expected here
                pass
        self._variants = self._meta = self._db = self._variants_h = None
        gc.collect()

    def _close_handles(self) -> None:
        self._variants.close()
        self._meta.close()
        self._db.close()

    def close(self) -> None:
        try:
            self._close_handles()
        except Exception as e:  # a full disk cannot take the flush at close
            log.warning("metadata in %s not flushed at close (%s): every acknowledged record is in its "
                        "write-ahead log and is replayed at the next start", self.path, e)
            self._drop_handles()

