"""A Store's commit (kvservice/store/commit.py): the host slab's copy is read back from
the payload file while the file is fsynced, straight into the slab; each layer is checked
against the layer as it arrived, and a payload file that does not read back is never
acknowledged. The disk writer hands written ranges to the kernel's writeback as the
stream goes on. ChunkStore in process, real files, real RocksDB, real shared memory."""

from __future__ import annotations

import mmap
import os

import pytest

from kvcraft.keys import ModelSpec
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.config import load_config
from kvservice.errors import Unavailable
from kvservice.index import Spec
from kvservice.store import ChunkStore
from kvservice.records import StoreHeader
from kvservice.store import commit as store_commit
from kvservice.tiers import disk

LAYERS, HEADS, TOKENS, DIM = 6, 2, 64, 32
MODEL = ModelSpec("commit", LAYERS, HEADS, DIM, "float32").fingerprint()
HALF = HEADS * TOKENS * DIM * 4  # bytes of K (or V) of one layer
TOTAL = LAYERS * 2 * HALF


def _layers(seed: int) -> list[tuple[bytes, bytes]]:
    rnd = __import__("random").Random(seed)
    return [(rnd.randbytes(HALF), rnd.randbytes(HALF)) for _ in range(LAYERS)]


@pytest.fixture(params=["thread", "inline"])
def fill_mode(request, monkeypatch):
    """The host copy filled by another thread during the fsync (big payloads), or after
    it in the committing thread (small ones): both ways for every test that takes it."""
    monkeypatch.setattr(store_commit, "FILL_THREAD_BYTES", 0 if request.param == "thread" else 1 << 40)
    return request.param


def _store(tmp_path, host_budget: int) -> ChunkStore:
    cfg = load_config(env={}, overrides={"data_dir": str(tmp_path / "data"), "host_budget_bytes": host_budget})
    return ChunkStore(cfg)


def _damage_on_disk(path, offset: int) -> None:
    """Overwrite the 4 KiB block at `offset` on the disk, around the page cache
    (O_DIRECT), as a disk fault would. The kernel drops the cached pages of a direct
    write's range; should a page of the old bytes stay cached, no read would see the
    fault, so once the file is on the disk the test drops it from the cache and checks
    that a plain read sees the damage (a skip, not a verdict, if it never does)."""
    block = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT wants
    block.write(b"\xff" * 4096)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError as e:  # e.g. a tmpfs /tmp
        pytest.skip(f"no O_DIRECT on the filesystem of {path}: {e}")
    try:
        assert os.pwrite(fd, block, offset) == 4096
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(100):
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if os.pread(fd, 4096, offset) == block[:]:
                return
        pytest.skip(f"the page cache of {path} keeps the block's old bytes; cannot stage a disk fault")
    finally:
        os.close(fd)


def _begin(store: ChunkStore, seed: int):
    spec = Spec(pb.FLOAT32, (HEADS, TOKENS, DIM))
    session = store.begin_store(StoreHeader(MODEL, [seed * 1000 + t for t in range(TOKENS)], (), LAYERS, spec, spec))
    for i, (k, v) in enumerate(_layers(seed)):
        session.add_layer(i, k, v)
    return session


def test_the_host_copy_made_at_commit_holds_the_layers_as_they_arrived(tmp_path, fill_mode):
    store = _store(tmp_path, host_budget=4 * TOTAL)
    try:
        result = _begin(store, 1).finish()
        host, home = store.tiers[0], store.tiers[-1]
        assert (host.name, home.name) == ("host", "disk")
        v = store.index.get(result.variant_id)
        assert v is not None and v.tier == "host"
        assert result.variant_id in host and result.variant_id in home
        expected = b"".join(k + v for k, v in _layers(1))
        shape = store._s.shape(v)
        assert bytes(host.get_layers(result.variant_id, 0, LAYERS, shape)) == expected
        assert bytes(home.get_layers(result.variant_id, 0, LAYERS, shape)) == expected
        assert host.usage() >= TOTAL
    finally:
        store.close()


def test_a_variant_the_host_does_not_admit_is_stored_on_disk_only(tmp_path):
    store = _store(tmp_path, host_budget=TOTAL // 2)
    try:
        result = _begin(store, 2).finish()
        v = store.index.get(result.variant_id)
        assert v is not None and v.tier == "disk"
        assert result.variant_id not in store.tiers[0] and store.tiers[0].usage() == 0
    finally:
        store.close()


def test_a_payload_file_that_does_not_read_back_is_never_acknowledged(tmp_path, fill_mode):
    store = _store(tmp_path, host_budget=4 * TOTAL)
    try:
        session = _begin(store, 3)
        # The file now holds other bytes than arrived in one block of layer 4's value
        # (a disk fault).
        _damage_on_disk(session.home.tmp, 4 * 2 * HALF + HALF + 4096)
        with pytest.raises(Unavailable, match="layer 4 of its payload file does not read back.*retry"):
            session.finish()
        assert store.index.get(session.variant_id) is None
        assert session.variant_id not in store.tiers[0] and session.variant_id not in store.tiers[-1]
        assert store.tiers[0].usage() == 0 and store.tiers[-1].usage() == 0
        payloads = tmp_path / "data" / "payloads"
        store.tiers[-1].wait_deletes()  # the renamed-aside file is unlinked by the reaper thread
        assert [p.name for p in payloads.rglob("*") if p.is_file()] == [], "payload or temporary file left"
        assert store._s.meta.load_variants() == [], "metadata committed for an unacknowledged Store"
        again = _begin(store, 3).finish()  # the same Store once more goes through
        assert store.index.get(again.variant_id) is not None
    finally:
        store.close()


def test_the_disk_writer_hands_written_ranges_to_writeback_as_the_stream_goes(tmp_path, monkeypatch):
    calls: list[tuple[int, int, int]] = []
    real = disk._SYNC_FILE_RANGE
    if real is None:
        pytest.skip("no sync_file_range on this platform")

    def record(fd: int, offset: int, n: int, flags: int) -> int:
        calls.append((offset, n, flags))
        return real(fd, offset, n, flags)

    monkeypatch.setattr(disk, "_SYNC_FILE_RANGE", record)
    monkeypatch.setattr(disk, "WRITEBACK_BYTES", 3 * HALF)  # every second layer (2 halves each)
    store = _store(tmp_path, host_budget=1)
    try:
        result = _begin(store, 4).finish()
        assert calls, "no writeback was started while the layers arrived"
        assert [c[0] for c in calls] == [sum(n for _, n, _ in calls[:i]) for i in range(len(calls))], \
            "ranges are not consecutive from the file's start"
        assert sum(n for _, n, _ in calls) == TOTAL  # every layer (the commit's fsync does the rest)
        assert {c[2] for c in calls} == {disk._SYNC_FILE_RANGE_WRITE}
        assert store.index.get(result.variant_id).tier == "disk"
    finally:
        store.close()


def test_the_fill_reads_the_payload_even_when_the_commit_renamed_it_first(tmp_path, monkeypatch, fill_mode):
    """The fill thread may start its first read after the commit's rename (small
    payloads, a busy machine): the file it reads must still be the payload."""
    from kvservice.tiers.slab import SlabWriter

    real = SlabWriter.fill_layer

    def late(self, read):  # noqa: ANN001 - SlabWriter.fill_layer's signature
        if self._pos == 0:  # first layer: wait until the payload sits under its final name
            final = tmp_path / "data" / "payloads" / self._vid[:2] / f"{self._vid}.kv"
            _wait_until(final.exists)
        return real(self, read)

    monkeypatch.setattr(SlabWriter, "fill_layer", late)
    store = _store(tmp_path, host_budget=4 * TOTAL)
    try:
        result = _begin(store, 5).finish()
        v = store.index.get(result.variant_id)
        assert v is not None and v.tier == "host"
        expected = b"".join(k + v for k, v in _layers(5))
        assert bytes(store.tiers[0].get_layers(result.variant_id, 0, LAYERS, store._s.shape(v))) == expected
    finally:
        store.close()


def _wait_until(cond, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)
