"""A data disk that turns read-only under the running service, for real: its payload folder
bind-mounted read-only, as the kernel remounts a filesystem read-only after disk errors (the
metadata's files, open for writing, keep the rest writable: a mount cannot turn read-only under
them). Stores answer FAILED_PRECONDITION naming the read-only filesystem, never INTERNAL with a
traceback; stored variants read back bit for bit; an Evict forgets its variant though the
payload cannot go (the next start adopts it back, whole); once the disk takes writes again,
Stores work without a restart; SIGTERM exits 0."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from kvclient.client import KVClient
from kvclient.errors import FailedPreconditionError
from kvcraft.keys import ModelSpec
from kvservice.launcher import ServiceProcess
from tests.conftest import random_layers

MODEL = ModelSpec("read-only", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32").fingerprint()
SHAPE = (2, 8, 16)


def _tokens(i: int) -> list[int]:
    return [i * 100 + t for t in range(8)]


def _read_only(folder: Path) -> None:
    for argv in (["mount", "--bind", str(folder), str(folder)], ["mount", "-o", "remount,bind,ro", str(folder)]):
        out = subprocess.run(argv, capture_output=True, text=True)
        if out.returncode != 0:
            subprocess.run(["umount", str(folder)], capture_output=True)
            pytest.skip(f"cannot mount here (needs root / CAP_SYS_ADMIN): {out.stderr.strip()}")


def _same(got, i: int) -> bool:
    return all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(got, random_layers(i, SHAPE, 2),
                                                                                    strict=True))


@pytest.mark.parametrize("local_store", [True, False], ids=["shared-memory", "grpc-stream"])
def test_a_read_only_disk_refuses_stores_by_name_keeps_reads_and_recovers(tmp_path, local_store):
    server = ServiceProcess(tmp_path / "data").start()
    payloads = tmp_path / "data" / "payloads"
    try:
        with KVClient(server.address, timeout=30, local_store=local_store) as c:
            keys = {i: c.store(MODEL, _tokens(i), random_layers(i, SHAPE, 2)).chunk_key for i in range(3)}
            _read_only(payloads)
            try:
                with pytest.raises(FailedPreconditionError, match="data directory is read-only"):
                    c.store(MODEL, _tokens(9), random_layers(9, SHAPE, 2))
                assert all(_same(c.fetch(key), i) for i, key in keys.items())
                assert c.evict(chunk_key=keys[0]).evicted == 1  # its payload stays on the read-only disk
                assert not c.lookup(chunk_key=keys[0]).found
                assert c.stats().leases == 0
            finally:
                subprocess.run(["umount", str(payloads)], check=True)
            keys[9] = c.store(MODEL, _tokens(9), random_layers(9, SHAPE, 2)).chunk_key  # writable again
            assert _same(c.fetch(keys[9]), 9)
        assert server.stop() == 0
        log = server.log()
        assert "Traceback" not in log, log[-3000:]
        server.start()
        with KVClient(server.address) as c:  # the evicted variant adopted back from its payload, whole
            assert all(_same(c.fetch(key), i) for i, key in keys.items())
    finally:
        server.close()
