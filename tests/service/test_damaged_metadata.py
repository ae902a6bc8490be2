"""Damaged metadata never costs a payload: a copied data dir with a
damaged SST, a truncated WAL or no metadata at all; the server refuses to start naming
the damage and `kvcraft repair`, or adopts what the payload files describe; after the
repair every intact variant is back, bit for bit. Damaged access records (hints) are
dropped and the start goes on."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from kvclient.client import KVClient
from kvcraft.keys import ModelSpec
from kvcraft.records import Ref
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.config import load_config
from kvservice.index import Spec
from kvservice.launcher import ServiceProcess
from kvservice.records import StoreHeader
from kvservice.metadata import MetadataDamaged
from kvservice.store import ChunkStore
from kvservice.segments import SHM_DIR, segment_prefix
from tests.conftest import random_layers

MODEL = ModelSpec("damage", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32").fingerprint()
SPEC = Spec(pb.FLOAT32, (1, 4, 8))
N = 24


def _tokens(i: int) -> list[int]:
    return [i * 10 + t for t in range(4)]


def _fill(data, *, kill: bool) -> None:
    s = ServiceProcess(data).start()
    with KVClient(s.address) as c:
        for i in range(N):
            c.store(MODEL, _tokens(i), random_layers(i))
    if kill:
        s.kill()  # the last records are only in the WAL
    else:
        assert s.stop() == 0  # a clean stop flushes them into an SST
    s.close()


def _payloads(data) -> set[str]:
    return {p.name for p in (data / "payloads").rglob("*.kv")}


def _all_back(data) -> None:
    with ServiceProcess(data) as s, KVClient(s.address) as c:
        assert c.stats().variants == N
        for i in range(N):
            got = c.fetch(c.lookup(MODEL, _tokens(i)).chunk_key)
            assert all(torch.equal(a, b) and torch.equal(x, y) for (a, x), (b, y) in zip(got, random_layers(i)))


def _segments(data) -> list[str]:
    """The shared-memory segments of service instances on `data` (the host slab's)."""
    return [p.name for p in SHM_DIR.glob(segment_prefix(data) + "*")]


def _refused(data) -> str:
    """Start the service on `data`: it refuses, naming the damage and the way out, and
    leaves nothing behind (its host slab's shared-memory segment, made at start-up,
    released; Python's resource_tracker would otherwise warn of it at exit)."""
    with pytest.raises(RuntimeError, match="exited with 2") as e:
        ServiceProcess(data).start()
    message = str(e.value)
    assert "damaged" in message and "kvcraft repair" in message and "Traceback" not in message
    assert "leaked shared_memory" not in message
    assert _segments(data) == []
    return message


def _repair(data) -> str:
    out = subprocess.run([sys.executable, "-m", "kvservice.cli", "repair", "--data-dir", str(data)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_damaged_sst_refuses_start_deletes_nothing_and_repair_brings_every_variant_back(tmp_path):
    original = tmp_path / "original"
    _fill(original, kill=False)
    data = tmp_path / "copy"
    shutil.copytree(original, data)
    before = _payloads(data)
    assert len(before) == N
    sst = max((data / "metadata").glob("*.sst"), key=lambda p: p.stat().st_size)
    raw = bytearray(sst.read_bytes())
    raw[len(raw) // 3] ^= 0xFF
    sst.write_bytes(bytes(raw))
    message = _refused(data)
    assert "Corruption" in message or "cannot open" in message
    assert _payloads(data) == before  # not one payload deleted
    assert f"{N} variants rebuilt" in _repair(data)
    assert list(data.glob("metadata.damaged-*"))  # the damaged metadata is kept aside
    _all_back(data)


def test_truncated_wal_loses_no_variant(tmp_path):
    original = tmp_path / "original"
    _fill(original, kill=True)
    data = tmp_path / "copy"
    shutil.copytree(original, data)
    (wal,) = [p for p in (data / "metadata").glob("*.log") if p.stat().st_size > 0]
    wal.write_bytes(wal.read_bytes()[: wal.stat().st_size // 2])
    _all_back(data)  # what the WAL lost is adopted from the payload files' own records


def test_missing_metadata_refuses_start_and_repair_brings_every_variant_back(tmp_path):
    data = tmp_path / "data"
    _fill(data, kill=False)
    shutil.rmtree(data / "metadata")
    assert "missing" in _refused(data)
    assert _refused(data)  # a refused start leaves no empty database behind that would hide the damage
    assert len(_payloads(data)) == N
    assert f"{N} variants rebuilt" in _repair(data)
    _all_back(data)


def test_damaged_access_records_are_dropped_and_the_start_goes_on(tmp_path, caplog):
    """Access records (fr, last access) are hints: a damaged table file among them does
    not stop the start nor cost a variant. They are dropped with a warning, the scores
    start from the variant records, and the damage is gone for good (a later compaction
    reading it would put RocksDB in an error state that refuses every write)."""
    def open_store():
        return ChunkStore(load_config(env={}, overrides={"data_dir": str(tmp_path / "data")}))

    store = open_store()
    stored = []
    for i in range(N * 8):
        s = store.begin_store(StoreHeader(MODEL, _tokens(i), (), 2, SPEC, SPEC))
        for layer, (k, v) in enumerate(random_layers(i)):
            s.add_layer(layer, k.numpy().tobytes(), v.numpy().tobytes())
        stored.append(s.finish().chunk_key)
    for key in stored:
        store.close_fetch(store.open_fetch([Ref(key)]), promote=False)
    store.close()  # flushes the access records into a table file of their own
    access_sst = [p for p in (tmp_path / "data" / "metadata").glob("*.sst")
                  if b"access" in p.read_bytes() and b"variants" not in p.read_bytes()]
    assert len(access_sst) == 1
    raw = bytearray(access_sst[0].read_bytes())
    raw[len(raw) // 3] ^= 0xFF
    access_sst[0].write_bytes(bytes(raw))

    with caplog.at_level("WARNING", logger="kvcraft.metadata"):
        store = open_store()
    assert "access records" in caplog.text and "damaged" in caplog.text
    assert len(store.index) == N * 8 and {v.fr for v in store.index} == {0.0}  # from the records
    for key in stored[:N]:
        store.close_fetch(store.open_fetch([Ref(key)]), promote=False)
    store.close()
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvcraft.metadata"):
        store = open_store()
    assert "damaged" not in caplog.text
    assert sorted(v.fr for v in store.index) == [0.0] * (N * 7) + [1.0] * N
    store.close()


def test_a_refused_store_releases_its_shared_memory_at_once(tmp_path):
    """In one process (as `kvcraft serve` and `kvcraft repair` open it): a ChunkStore
    that refuses damaged metadata leaves no segment of its data dir in /dev/shm, and
    the same process can start on the repaired data dir."""
    data = tmp_path / "data"
    _fill(data, kill=False)
    shutil.rmtree(data / "metadata")
    cfg = load_config(env={}, overrides={"data_dir": str(data)})
    for _ in range(2):
        with pytest.raises(MetadataDamaged, match="missing"):
            ChunkStore(cfg)
        assert _segments(data) == []
    _repair(data)
    store = ChunkStore(cfg)
    assert len(store.index) == N and len(_segments(data)) == 1
    store.close()
    assert _segments(data) == []
