"""A synced metadata write reaches the disk through os.fsync of RocksDB's write-ahead
log (rocksdict's own synced write holds the GIL for the whole sync, stalling the
server's event loop on every Store; docs/benchmarks.md, load)."""

from __future__ import annotations

import os

from kvservice import metadata
from kvservice.metadata import MetadataDB
from tests.planner.helpers import key, variant


def _recording_fsync(monkeypatch) -> list[str]:
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(metadata.os, "fsync", fsync)
    return synced


def _wal_holding(path, marker: bytes) -> list[str]:
    return [e.path for e in os.scandir(path) if e.name.endswith(".log") and marker in open(e.path, "rb").read()]


def test_a_synced_write_fsyncs_the_log_file_that_holds_it_and_an_unsynced_one_does_not(tmp_path, monkeypatch):
    db = MetadataDB(tmp_path / "meta")
    try:
        synced = _recording_fsync(monkeypatch)
        db.put_variants([variant(key("unsynced"), [])], sync=False)
        assert synced == []
        v = variant(key("synced"), [])
        db.put_variants([v], sync=True)
        holding = _wal_holding(tmp_path / "meta", v.variant_id.encode())
        assert holding, "the record is in a write-ahead log file (RocksDB wrote it before returning)"
        assert set(holding) <= set(synced)
        assert {r.variant_id for r in db.load_variants()} == {variant(key("unsynced"), []).variant_id, v.variant_id}
    finally:
        db.close()
