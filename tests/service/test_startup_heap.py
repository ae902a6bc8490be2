"""`kvcraft serve` keeps its recovered index out of the cyclic garbage collector's scans
(kvservice.server.heap.freeze_startup_heap): a full collection walks every tracked
object while holding the GIL, 0.81 s at a million variants. The server's start-up log
says how many objects it froze; they must include the recovered variants' records."""

from __future__ import annotations

import re

import torch

from kvclient.client import KVClient
from kvcraft.keys import ModelSpec
from kvservice.launcher import ServiceProcess

MODEL = ModelSpec("heap", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32").fingerprint()
N = 60


def _frozen(log: str) -> int:
    counts = re.findall(r"(\d+) start-up objects frozen", log)
    assert counts, log[-2000:]
    return int(counts[-1])


def test_recovered_index_is_frozen_at_start(tmp_path):
    data = tmp_path / "data"
    with ServiceProcess(data) as s:
        empty = _frozen(s.log())
        with KVClient(s.address) as c:
            g = torch.Generator().manual_seed(0)
            for i in range(N):
                c.store(MODEL, [i * 10 + t for t in range(4)],
                        [(torch.randn(1, 4, 8, generator=g), torch.randn(1, 4, 8, generator=g)) for _ in range(2)])
        assert s.stop() == 0
    with ServiceProcess(data) as s, KVClient(s.address) as c:
        assert c.stats().variants == N
        assert _frozen(s.log()) >= empty + N  # at least one frozen object per recovered variant
