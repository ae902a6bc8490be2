"""Durable metadata writes are group-committed off the GIL (kvservice/metadata.py):
a write returns only after an fsync of the write-ahead log file holding it, begun after
it was written; writes that arrive while a group commits share the next group's one
fsync; an unsynced write fsyncs nothing. (rocksdict's own synced write holds the GIL
for the whole sync, stalling the server's event loop on every Store: docs/benchmarks.md.)"""

from __future__ import annotations

import os
import threading
import time

from kvservice import metadata
from kvservice.metadata import MetadataDB
from tests.planner.helpers import key, variant


def _wal_holding(path, marker: bytes) -> list[str]:
    return [e.path for e in os.scandir(path) if e.name.endswith(".log") and marker in open(e.path, "rb").read()]


class _Fsyncs:
    """Records os.fsync calls of the metadata module (path, and what the log files held
    at that moment); calls can be held until released."""

    def __init__(self, monkeypatch, db_path) -> None:
        self.calls: list[tuple[str, set[str]]] = []
        self.db_path = db_path
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        real = os.fsync

        def fsync(fd: int) -> None:
            path = os.readlink(f"/proc/self/fd/{fd}")
            if path.endswith(".log"):
                self.entered.set()
                assert self.gate.wait(30), "fsync held too long"
            held = set()
            for e in os.scandir(db_path):
                if e.name.endswith(".log"):
                    data = open(e.path, "rb").read()
                    held |= {m for m in self.markers if m in data}
            self.calls.append((path, held))
            real(fd)

        self.markers: list[bytes] = []
        monkeypatch.setattr(metadata.os, "fsync", fsync)

    def log_syncs(self) -> list[set[bytes]]:
        return [held for path, held in self.calls if path.endswith(".log")]


def _wait_until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_a_synced_write_fsyncs_the_log_file_that_holds_it_and_an_unsynced_one_does_not(tmp_path, monkeypatch):
    db = MetadataDB(tmp_path / "meta")
    try:
        fs = _Fsyncs(monkeypatch, tmp_path / "meta")
        quiet = variant(key("unsynced"), [])
        db.put_variants([quiet], sync=False)
        assert fs.calls == []
        v = variant(key("synced"), [])
        fs.markers = [v.variant_id.encode()]
        db.put_variants([v], sync=True)
        holding = _wal_holding(tmp_path / "meta", v.variant_id.encode())
        assert holding, "the record is in a write-ahead log file (RocksDB wrote it before returning)"
        assert set(holding) <= {p for p, _ in fs.calls}
        assert any(v.variant_id.encode() in held for held in fs.log_syncs()), \
            "the log was fsynced after the record reached it"
        assert {vid for vid, _ in db.load_variants()} == {quiet.variant_id, v.variant_id}
    finally:
        db.close()


def test_writes_arriving_during_a_commit_share_the_next_groups_one_fsync(tmp_path, monkeypatch):
    db = MetadataDB(tmp_path / "meta")
    try:
        fs = _Fsyncs(monkeypatch, tmp_path / "meta")
        first = variant(key("first"), [])
        rest = [variant(key(f"later{i}"), []) for i in range(5)]
        fs.markers = [x.variant_id.encode() for x in [first, *rest]]
        returned: list[str] = []
        errors: list[BaseException] = []

        def put(v) -> None:
            try:
                db.put_variants([v], sync=True)
                returned.append(v.variant_id)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        fs.gate.clear()  # the first group's fsync waits until the others queued
        lead = threading.Thread(target=put, args=(first,))
        lead.start()
        assert fs.entered.wait(30), "the first write never reached its fsync"
        others = [threading.Thread(target=put, args=(v,)) for v in rest]
        for t in others:
            t.start()
        _wait_until(lambda: len(db._queue) == len(rest), "the later writes never queued")
        assert returned == [], "a write returned before its fsync"
        fs.gate.set()
        for t in [lead, *others]:
            t.join(30)
        assert not errors, errors
        assert sorted(returned) == sorted(x.variant_id for x in [first, *rest])
        syncs = fs.log_syncs()
        assert len(syncs) == 2, f"expected one fsync per group (2 groups), got {len(syncs)}"
        assert first.variant_id.encode() in syncs[0]
        assert {x.variant_id.encode() for x in rest} <= syncs[1], "a later write was not in the log at its fsync"
        assert {vid for vid, _ in db.load_variants()} == {x.variant_id for x in [first, *rest]}
    finally:
        db.close()


def test_a_failed_group_commit_fails_every_write_of_the_group(tmp_path, monkeypatch):
    db = MetadataDB(tmp_path / "meta")
    try:
        def broken(fd: int) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(metadata.os, "fsync", broken)
        v = variant(key("lost"), [])
        try:
            db.put_variants([v], sync=True)
        except OSError as e:
            assert e.errno == 5
        else:
            raise AssertionError("a write whose fsync failed returned")
        monkeypatch.undo()
        w = variant(key("next"), [])
        db.put_variants([w], sync=True)  # the next group commits normally
        assert w.variant_id in {vid for vid, _ in db.load_variants()}
    finally:
        db.close()
