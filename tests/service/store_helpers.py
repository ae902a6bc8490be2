"""A real store over a data dir, variants of random bytes, and the host slab's room."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvcraft.keys import ModelSpec
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.config import load_config
from kvservice.index import Spec
from kvservice.records import StoreHeader
from kvservice.store import ChunkStore
from kvservice.tiers import PayloadShape, Tier, TierFull

MODEL = ModelSpec("fill", num_layers=4, num_kv_heads=2, head_dim=8, dtype="float32").fingerprint()


def half_bytes(tokens: int) -> int:
    """K (or V) of one layer: [2, tokens, 8] fp32."""
    return 2 * tokens * 8 * 4


def open_store(root: Path, host_bytes: int) -> ChunkStore:
    return ChunkStore(load_config(env={}, overrides={"data_dir": str(root), "host_budget_bytes": host_bytes}))


def store_variant(store: ChunkStore, seed: int, layers: int, tokens: int) -> tuple[str, list[tuple[bytes, bytes]]]:
    """Store a variant of random K and V; its chunk key and the layers sent."""
    rnd = random.Random(seed)
    half = half_bytes(tokens)
    sent = [(rnd.randbytes(half), rnd.randbytes(half)) for _ in range(layers)]
    spec = Spec(pb.FLOAT32, (2, tokens, 8))
    s = store.begin_store(StoreHeader(MODEL, [seed * 100_000 + i for i in range(tokens)], (), layers, spec, spec))
    for i, (k, v) in enumerate(sent):
        s.add_layer(i, k, v)
    return s.finish().chunk_key, sent


def assert_no_room_reserved(host: Tier, committed: int = 0) -> None:
    """The host slab holds `committed` bytes of copies (placed first) and no writer's
    extent besides: the rest of the slab opens as one run."""
    assert host.usage() == committed
    try:
        host.open_writer("f" * 32, PayloadShape(1, host.budget_bytes - committed)).abort()
    except TierFull:
        pytest.fail("room of the host slab is still reserved")
