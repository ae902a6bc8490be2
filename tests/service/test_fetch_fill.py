"""A fetch from disk fills the host tier's copy with the very reads it serves
(kvservice/store/promotion.py, `Fill`): real host and disk tiers, no gRPC."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcraft.records import Ref
from kvservice.errors import NotFound
from kvservice.store import ChunkStore
from kvservice.tiers import PayloadShape, Tier
from tests.service.store_helpers import assert_no_room_reserved, half_bytes, open_store, store_variant

LAYERS = 4
TOKENS = 16
HALF = half_bytes(TOKENS)
SHAPE = PayloadShape(LAYERS, 2 * HALF)
HOST_BYTES = 1 << 20


@pytest.fixture
def on_disk(tmp_path: Path):
    """A store whose one variant is on disk only: stored, then the store opened again
    (the host slab starts empty)."""
    store = open_store(tmp_path / "data", HOST_BYTES)
    key, layers = store_variant(store, 1, LAYERS, TOKENS)
    store.close()
    store = open_store(tmp_path / "data", HOST_BYTES)
    (v,) = store.index.variants_of(key)
    assert v.variant_id not in store.tiers[0] and v.tier == "disk"
    yield store, key, layers
    store.close()


def disk_reads(store: ChunkStore) -> int:
    (disk,) = [t for t in store.stats().tiers if t.name == "disk"]
    return disk.layer_reads


def read(store: ChunkStore, held, layer: int) -> tuple[bytes, bytes]:
    k, v = store.read_layer(held, layer)
    return bytes(k), bytes(v)


def host_copy(host: Tier, vid: str) -> list[bytes]:
    return [bytes(host.get_layer(vid, i, SHAPE)) for i in range(LAYERS)]


def test_a_fetch_from_disk_reads_each_layer_once_and_leaves_an_identical_host_copy(on_disk):
    store, key, layers = on_disk
    host = store.tiers[0]
    before = disk_reads(store)
    (held,) = store.open_fetch([Ref(key)])
    got = [read(store, held, i) for i in range(LAYERS)]
    store.close_fetch([held])
    assert got == layers
    assert disk_reads(store) - before == LAYERS  # the stream's reads filled the copy: no second pass
    assert held.tier == "host"
    assert host_copy(host, held.variant_id) == [k + v for k, v in layers]
    hits = store.counters.hits["host"]
    (again,) = store.open_fetch([Ref(key)])
    assert [read(store, again, i) for i in range(LAYERS)] == layers
    store.close_fetch([again])
    assert store.counters.hits["host"] == hits + LAYERS and disk_reads(store) - before == LAYERS


def test_a_fetch_that_stops_early_leaves_no_host_copy_and_no_reserved_room(on_disk):
    store, key, layers = on_disk
    (held,) = store.open_fetch([Ref(key)])
    assert [read(store, held, i) for i in range(2)] == layers[:2]
    store.close_fetch([held], promote=False)  # what the server does when the client leaves
    assert held.tier == "disk" and held.variant_id not in store.tiers[0]
    assert_no_room_reserved(store.tiers[0])


def test_a_fetch_of_some_layers_falls_back_to_promotion(on_disk):
    store, key, layers = on_disk
    before = disk_reads(store)
    (held,) = store.open_fetch([Ref(key)])
    assert [read(store, held, i) for i in (1, 2)] == layers[1:3]  # FetchLayers first_layer=1, num_layers=2
    store.close_fetch([held])
    assert host_copy(store.tiers[0], held.variant_id) == [k + v for k, v in layers]
    assert disk_reads(store) - before == 2 + LAYERS  # the stream's two, then promotion's pass


def test_a_copy_outlives_a_fetch_that_stops_early_while_another_fills_it(on_disk):
    store, key, layers = on_disk
    before = disk_reads(store)
    (first,) = store.open_fetch([Ref(key)])
    (second,) = store.open_fetch([Ref(key)])
    assert read(store, first, 0) == layers[0]  # into the copy
    assert read(store, second, 0) == layers[0]  # the copy has it: read for the stream only
    store.close_fetch([first], promote=False)
    assert [read(store, second, i) for i in range(1, LAYERS)] == layers[1:]
    store.close_fetch([second])
    assert host_copy(store.tiers[0], second.variant_id) == [k + v for k, v in layers]
    assert disk_reads(store) - before == 1 + LAYERS


def test_a_corrupt_layer_on_disk_answers_not_found_drops_the_variant_and_copies_nothing(on_disk):
    store, key, layers = on_disk
    (v,) = store.index.variants_of(key)
    path = store.tiers[1].path_of(v.variant_id)
    data = bytearray(path.read_bytes())
    data[SHAPE.offset(2) + HALF + 5] ^= 0x40  # a byte of layer 2's V
    path.write_bytes(data)
    (held,) = store.open_fetch([Ref(key)])
    assert [read(store, held, i) for i in range(2)] == layers[:2]
    with pytest.raises(NotFound, match="layer 2 failed its checksum"):
        store.read_layer(held, 2)
    store.close_fetch([held])
    assert not store.index.variants_of(key) and store.counters.corrupt == 1
    assert_no_room_reserved(store.tiers[0])
