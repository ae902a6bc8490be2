"""Crash safety: SIGKILL at random moments and at each step of the write order."""

from __future__ import annotations

import pytest
import torch

from kvbench.service.crash import run
from kvclient.client import KVClient
from kvclient.errors import KVCraftError
from kvcraft.keys import ModelSpec, chunk_key
from kvservice.launcher import ServiceProcess
from tests.conftest import random_layers

pytestmark = pytest.mark.slow  # over ~10 s: after the inner loop (README, "Developing")

MODEL = ModelSpec("crash", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32").fingerprint()


def test_sigkill_during_store_evict_loop_keeps_every_acknowledged_write(tmp_path):
    # Kills up to 0.4 s into each round (the benchmark's 0.12 s left a CPU shared with the
    # suite's other workers about two writes a round).
    rep = run(tmp_path / "data", rounds=30, seed=3, max_delay_s=0.4)
    print(f"crash loop: {rep}")
    assert rep.violations == []
    assert rep.kills == 30
    assert rep.acked_stores > 60 and rep.acked_evicts > 10  # the loop really did work between kills
    assert rep.verified_fetches > rep.acked_stores  # survivors were re-read after every restart


@pytest.mark.parametrize("point,survives", [
    ("store:payload-written", False),
    # durable but unacknowledged: complete, so allowed (the payload carries its record
    # and is adopted at start)
    ("store:payload-committed", True),
    ("store:metadata-committed", True),
])
def test_crash_at_each_step_of_a_store(tmp_path, point, survives):
    data = tmp_path / "data"
    with ServiceProcess(data) as s, KVClient(s.address) as c:
        c.store(MODEL, [1, 2, 3, 4], random_layers(0))
    crashing = ServiceProcess(data, env={"KVCRAFT_FAILPOINT": point}).start()
    with KVClient(crashing.address) as c, pytest.raises(KVCraftError):
        c.store(MODEL, [5, 6, 7, 8], random_layers(1))
    assert crashing.proc.wait(timeout=30) == 137
    crashing.close()
    with ServiceProcess(data) as s, KVClient(s.address) as c:
        assert c.lookup(chunk_key=chunk_key(MODEL, [5, 6, 7, 8])).found == survives
        for tokens, seed in [([1, 2, 3, 4], 0)] + ([([5, 6, 7, 8], 1)] if survives else []):
            got = c.fetch(chunk_key(MODEL, tokens))
            assert all(torch.equal(a, b) and torch.equal(x, y) for (a, x), (b, y) in zip(got, random_layers(seed)))
    files = [p.name for p in (data / "payloads").rglob("*") if p.is_file()]
    assert len(files) == (2 if survives else 1) and all(f.endswith(".kv") for f in files)


def test_crash_between_delete_metadata_and_payload_brings_the_variant_back_whole(tmp_path):
    data = tmp_path / "data"
    crashing = ServiceProcess(data, env={"KVCRAFT_FAILPOINT": "delete:metadata-deleted"}).start()
    with KVClient(crashing.address) as c:
        key = c.store(MODEL, [1, 2, 3, 4], random_layers(0)).chunk_key
        with pytest.raises(KVCraftError):
            c.evict(chunk_key=key)
    crashing.proc.wait(timeout=30)
    crashing.close()
    assert len(list((data / "payloads").rglob("*.kv"))) == 1  # metadata first: the payload is still there
    with ServiceProcess(data) as s, KVClient(s.address) as c:
        assert "adopted 1" in s.log()  # its file carries its record: the unacknowledged eviction is undone
        got = c.fetch(key)
        assert all(torch.equal(a, b) and torch.equal(x, y) for (a, x), (b, y) in zip(got, random_layers(0)))
        assert c.stats().variants == 1


def _flip(path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_flipped_payload_byte_is_not_found_and_dropped(start_server):
    server = start_server()
    with KVClient(server.address) as c:
        stored = c.store(MODEL, [1, 2, 3, 4], random_layers(0))
        key = stored.chunk_key
        other = c.store(MODEL, [9, 9], [(k[:, :2], v[:, :2]) for k, v in random_layers(1)]).chunk_key
    server.restart()  # host tier is empty after a restart: the next read comes from disk
    (path,) = (server.data_dir / "payloads").rglob(f"{stored.variant_id}.kv")
    _flip(path, 200)  # a byte of layer 1's K
    with KVClient(server.address) as c:
        with pytest.raises(KVCraftError) as e:
            c.fetch(key)
        assert e.value.code.name == "NOT_FOUND" and "failed its checksum" in e.value.message
        assert not c.lookup(chunk_key=key).found
        assert not path.exists()
        assert c.fetch(other)  # the neighbour is untouched


def test_payload_damaged_while_down_is_dropped_at_its_first_read(tmp_path):
    data = tmp_path / "data"
    with ServiceProcess(data) as s, KVClient(s.address) as c:
        key = c.store(MODEL, [1, 2, 3, 4], random_layers(0)).chunk_key
    (path,) = list((data / "payloads").rglob("*.kv"))
    _flip(path, 7)  # a byte of layer 0's K
    with ServiceProcess(data) as s, KVClient(s.address) as c:
        assert c.stats().variants == 1  # a start reads no payload of the disk, which verifies every read
        with pytest.raises(KVCraftError) as e:
            c.fetch(key)
        assert e.value.code.name == "NOT_FOUND" and "failed its checksum" in e.value.message
        assert not c.lookup(chunk_key=key).found and c.stats().variants == 0
        assert not path.exists()
