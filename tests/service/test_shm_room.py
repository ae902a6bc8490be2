"""The host slab against a small /dev/shm, for real: the service in a mount namespace of its own
with a 16 MiB tmpfs at /dev/shm (a container's is 64 MiB unless it is given more), and
host_budget_bytes far above it. The slab is a sparse segment: without a check it starts fine and
a copy into a page the tmpfs cannot back fails later. So the start fits the slab to the room there
(and says so), and once another process takes the rest of /dev/shm, the host tier is full, not
broken: every Store is acknowledged, every variant reads back bit for bit (none dropped as if
its payload file were unreadable), and the service stays up."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kvclient.client import KVClient
from kvcraft.keys import ModelSpec
from kvservice.launcher import ServiceProcess

MODEL = ModelSpec("shm-room", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32").fingerprint()
TOKENS = 512  # a variant: 4 layers x K, V of [2, 512, 64] fp32 = 2 MiB
SMALL_SHM = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=16m tmpfs /dev/shm && exec "$@"', "sh"]


def _layers(i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((2, TOKENS, 64), float(i)), torch.full((2, TOKENS, 64), -float(i)))] * 4


def _fill(folder: str) -> None:
    fd = os.open(os.path.join(folder, "another-process"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * (1 << 20))
    except OSError:  # ENOSPC: /dev/shm is full
        pass
    finally:
        os.close(fd)


def test_a_small_dev_shm_fits_the_host_tier_and_a_full_one_loses_no_variant(tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a mount namespace with its own /dev/shm needs root and unshare (util-linux)")
    server = ServiceProcess(tmp_path / "data", prefix=SMALL_SHM, host_budget_bytes=1 << 30).start()
    try:
        assert "the host tier holds" in server.log()  # fitted at the start, and said
        with KVClient(server.address, local_store=False, timeout=30) as c:
            keys = {i: c.store(MODEL, [i * 1000 + t for t in range(TOKENS)], _layers(i)).chunk_key for i in range(2)}
            _fill(f"/proc/{server.proc.pid}/root/dev/shm")  # the service's /dev/shm, seen from here
            for i in range(2, 12):
                keys[i] = c.store(MODEL, [i * 1000 + t for t in range(TOKENS)], _layers(i)).chunk_key
            for _ in range(2):  # the second round: reads that would copy up into the host tier
                for i, key in keys.items():
                    got = c.fetch(key)
                    assert all(bool((k == i).all()) and bool((v == -i).all()) for k, v in got), i
            assert c.stats().variants == len(keys)
        assert server.proc.poll() is None
        log = server.log()
        assert "dropping variant" not in log and "Traceback" not in log, log[-3000:]
        assert server.stop() == 0
    finally:
        server.close()
