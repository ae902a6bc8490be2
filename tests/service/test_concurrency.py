"""Stores commit outside the store lock: identical concurrent stores
still make exactly one variant, and every one of them is answered."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from kvclient.client import KVClient
from kvcraft.keys import ModelSpec

MODEL = ModelSpec("concurrent", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32").fingerprint()
LAYERS = [(torch.full((1, 3, 4), 1.0), torch.full((1, 3, 4), 2.0))] * 2


def test_identical_concurrent_stores_make_one_variant(kvserver):
    def store(i: int):
        with KVClient(kvserver.address) as c:
            return c.store(MODEL, [1, 2, 3], LAYERS, prefix_keys=[])

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(store, range(16)))
    assert len({r.variant_id for r in results}) == 1
    assert sum(not r.already_present for r in results) == 1
    with KVClient(kvserver.address) as c:
        assert c.stats().variants == 1
        assert c.stats().tiers[1].bytes_used == results[0].bytes_stored
        assert all(torch.equal(k, k0) for (k, _), (k0, _) in zip(c.fetch(results[0].chunk_key), LAYERS))
    assert not list((kvserver.data_dir / "payloads").rglob("*.tmp"))
