"""The store with a gpu tier on top (gpu -> host -> disk), on the fake device: a fetch
from disk fills the gpu pool's copy with the layers it reads (verified), a promotion reads
the payload file straight into the pool, reads are served from it, its usage is
accounted in whole pages, and under pressure its lowest-fr copies move one tier down
into host. No gRPC: the store's own API."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvcraft.keys import ModelSpec
from kvcraft.records import Ref
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.config import load_config
from kvservice.index import Spec
from kvservice.records import StoreHeader
from kvservice.store import ChunkStore
from kvservice.tiers.disk import DiskTier
from kvservice.tiers import build_tiers
from kvservice.tiers.disk_backend import ALIGN, KvikioBackend, PosixBackend
from kvservice.tiers.gpu import GpuTier
from kvservice.segments import segment_name
from kvservice.tiers.host import HostTier

from .fakes import FakeDriver, FakeKvikio

LAYERS, HEADS, TOKENS, DIM = 2, 2, 40, 8
MODEL = ModelSpec("gpu-store", LAYERS, HEADS, DIM, "float32").fingerprint()
HALF = HEADS * TOKENS * DIM * 4  # bytes of K (or V) of one layer: 2560
SIZE = LAYERS * 2 * HALF  # 10240 bytes: 2.5 pages, so 3 whole 4 KiB pages in the gpu pool
PAGES = 3
SPEC = Spec(pb.FLOAT32, (HEADS, TOKENS, DIM))


class Node:
    def __init__(self, tmp_path: Path, gpu_pages: int, host_bytes: int) -> None:
        self.driver = FakeDriver()
        self.kvikio = FakeKvikio(self.driver)
        root = tmp_path / "data"
        cfg = load_config(env={}, overrides={"data_dir": str(root), "host_budget_bytes": host_bytes,
                                             "disk_budget_bytes": 1 << 20})
        root.mkdir(parents=True, exist_ok=True)
        self.gpu = GpuTier(gpu_pages * ALIGN, self.driver, KvikioBackend(self.kvikio, self.driver))
        self.host = HostTier(host_bytes, segment_name(root, "test"), self.driver)
        self.store = ChunkStore(cfg, tiers=[self.gpu, self.host, DiskTier(root / "payloads", 1 << 20)])
        self.sent: dict[str, list[tuple[bytes, bytes]]] = {}

    def put(self, seed: int) -> str:
        rnd = __import__("random").Random(seed)
        layers = [(rnd.randbytes(HALF), rnd.randbytes(HALF)) for _ in range(LAYERS)]
        s = self.store.begin_store(StoreHeader(MODEL, [seed * 100 + i for i in range(TOKENS)], (), LAYERS, SPEC, SPEC))
        for i, (k, v) in enumerate(layers):
            s.add_layer(i, k, v)
        key = s.finish().chunk_key
        self.sent[key] = layers
        return key

    def fetch(self, key: str, cfo: float | None = None) -> None:
        (v,) = self.store.open_fetch([Ref(key, cfo=cfo)])
        try:
            for i, (k, val) in enumerate(self.sent[key]):
                got_k, got_v = self.store.read_layer(v, i)
                assert bytes(got_k) == k and bytes(got_v) == val
        finally:
            self.store.close_fetch([v])

    def tier_of(self, key: str) -> str:
        (v,) = self.store.index.variants_of(key)
        return v.tier

    def close(self) -> None:
        self.store.close()


@pytest.fixture
def node(tmp_path: Path):
    n = Node(tmp_path, gpu_pages=2 * PAGES, host_bytes=1)  # host too small for any variant
    yield n
    n.close()


def test_stores_skip_the_gpu_and_a_fetch_fills_it_with_the_layers_it_reads(node: Node) -> None:
    key = node.put(0)
    assert node.tier_of(key) == "disk" and node.gpu.usage() == 0  # cache_on_store is off for gpu
    node.fetch(key)  # read from disk (verified), each layer copied up into the gpu pool as it goes
    assert node.tier_of(key) == "gpu"
    assert node.kvikio.preads == [] and node.store.counters.layer_reads["disk"] == LAYERS  # no second read
    hits = node.store.counters.hits["gpu"]
    node.fetch(key)
    assert node.store.counters.hits["gpu"] == hits + LAYERS  # served from the gpu pool, bit-identical
    assert node.gpu.usage() == PAGES * ALIGN  # 10240 bytes, accounted in whole pages


def test_a_promotion_reads_straight_from_disk_into_the_gpu_through_kvikio(node: Node) -> None:
    key = node.put(0)
    (v,) = node.store.index.variants_of(key)
    node.store.promote([v.variant_id])  # what Plan's preload and Locate do
    assert node.tier_of(key) == "gpu"
    # the file's two whole pages through kvikio (its last half page with POSIX)
    assert [(n, off) for _, n, off, _ in node.kvikio.preads] == [(2 * ALIGN, 0)]
    hits = node.store.counters.hits["gpu"]
    node.fetch(key)
    assert node.store.counters.hits["gpu"] == hits + LAYERS  # bit-identical from the pool


def test_a_corrupt_payload_is_never_promoted_into_the_gpu(node: Node) -> None:
    key = node.put(1)
    (v,) = node.store.index.variants_of(key)
    path = node.store.tiers[2].path_of(v.variant_id)
    data = bytearray(path.read_bytes())
    data[HALF * 3 + 5] ^= 0x40  # a byte of layer 1's V
    path.write_bytes(data)
    node.store.promote([v.variant_id])
    assert not node.store.index.variants_of(key)  # dropped: the engine recomputes
    assert node.gpu.usage() == 0 and node.store.counters.corrupt == 1


def test_gpu_pressure_moves_the_lowest_fr_copy_into_host(tmp_path: Path) -> None:
    node = Node(tmp_path, gpu_pages=2 * PAGES, host_bytes=4 * SIZE)
    try:
        keys = [node.put(i) for i in range(3)]
        assert all(node.tier_of(k) == "host" for k in keys)  # stores land in host + disk
        for k in keys:
            node.host.delete(node.store.index.variants_of(k)[0].variant_id)  # host forgets them
            node.store._s.retier(node.store.index.variants_of(k)[0])  # noqa: SLF001
        node.fetch(keys[0], cfo=0.1)  # fr 10
        node.fetch(keys[1], cfo=0.5)  # fr 2
        assert [node.tier_of(k) for k in keys[:2]] == ["gpu", "gpu"] and node.gpu.usage() == 2 * PAGES * ALIGN
        node.fetch(keys[2], cfo=0.2)  # fr 5: the gpu pool is full; keys[1] (fr 2) goes down
        assert [node.tier_of(k) for k in keys] == ["gpu", "host", "gpu"]
        assert node.gpu.usage() == 2 * PAGES * ALIGN
        node.fetch(keys[1])  # still served, now from host, bit-identical
    finally:
        node.close()


def test_leased_copies_are_never_moved_out_of_the_gpu(tmp_path: Path) -> None:
    node = Node(tmp_path, gpu_pages=PAGES, host_bytes=4 * SIZE)
    try:
        a, b = node.put(0), node.put(1)
        node.fetch(a)
        assert node.tier_of(a) == "gpu"
        node.store.take_lease([Ref(a)])
        node.fetch(b, cfo=0.01)  # far hotter, but a is leased: b stays below
        assert node.tier_of(a) == "gpu" and node.tier_of(b) == "host"
    finally:
        node.close()


def test_build_tiers_puts_a_configured_gpu_pool_first_and_pins_the_slab(tmp_path: Path) -> None:
    driver = FakeDriver()
    cfg = load_config(env={}, overrides={"data_dir": str(tmp_path / "a"), "host_budget_bytes": 3 * ALIGN,
                                         "gpu_budget_bytes": 5 * ALIGN, "disk_backend": "posix"})
    tiers = build_tiers(cfg, "test", driver)
    try:
        assert [t.name for t in tiers] == ["gpu", "host", "disk"]
        assert tiers[0].budget_bytes == 5 * ALIGN and isinstance(tiers[0].disk_backend, PosixBackend)
        assert list(driver.registered.values()) == [3 * ALIGN]  # the host slab, page-locked
    finally:
        for t in tiers:
            t.close()
    assert driver.registered == {} and driver.allocations == {}  # unpinned, pool freed
    off = load_config(env={}, overrides={"data_dir": str(tmp_path / "b")})
    tiers = build_tiers(off, "test", FakeDriver())
    assert [t.name for t in tiers] == ["host", "disk"]  # gpu_budget_bytes = 0: no gpu tier
    for t in tiers:
        t.close()


def test_on_a_cpu_host_the_service_says_once_what_is_off(tmp_path: Path, fresh_driver_state, caplog) -> None:  # noqa: ANN001
    from kvservice.tiers import gpu_driver

    if gpu_driver.load(0) is not None:
        pytest.skip("this host has a CUDA driver")
    gpu_driver._loaded.clear()  # noqa: SLF001 - probe again, this time under caplog
    cfg = load_config(env={}, overrides={"data_dir": str(tmp_path / "a")})
    with caplog.at_level(logging.INFO, logger="kvcraft"):
        tiers = build_tiers(cfg, "test")
    for t in tiers:
        t.close()
    assert [t.name for t in tiers] == ["host", "disk"]
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["no usable CUDA driver"]
    caplog.clear()
    asked = load_config(env={}, overrides={"data_dir": str(tmp_path / "b"), "gpu_budget_bytes": 1 << 20})
    with caplog.at_level(logging.INFO, logger="kvcraft"):
        tiers = build_tiers(asked, "test")
    for t in tiers:
        t.close()
    assert [t.name for t in tiers] == ["host", "disk"]
    assert [r.getMessage() for r in caplog.records] == [
        "gpu_budget_bytes is set but no CUDA driver loads: running without the gpu tier"]


@pytest.mark.parametrize("bad,message", [({"disk_backend": "gds"}, 'disk_backend must be "posix" or "kvikio"'),
                                         ({"gpu_budget_bytes": -1}, "gpu_budget_bytes and gpu_device must be >= 0")])
def test_bad_gpu_settings_are_refused_at_the_edge(tmp_path: Path, bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(env={}, overrides={"data_dir": str(tmp_path), **bad})


def test_locate_says_where_a_variant_lies_in_the_gpu_pool_and_an_engine_maps_it(tmp_path: Path) -> None:
    """Locate -> wire -> LocalFetch: the gpu tier's IPC handle and the variant's place in
    the pool reach the engine, which reads the layers in place (fake device)."""
    import torch

    from kvcraft.v1 import kvcraft_pb2
    from kvclient.gpu_pool import GpuPool
    from kvclient.local import LocalFetch
    from kvservice import wire

    from .test_gpu_pool import FakeOpener

    node = Node(tmp_path, gpu_pages=2 * PAGES, host_bytes=4 * SIZE)
    try:
        a, b = node.put(0), node.put(1)
        node.fetch(a)  # promoted into the gpu; b stays in host only
        located = node.store.locate([Ref(a), Ref(b)])
        assert located.gpu is not None and located.gpu.ipc_handle == node.gpu.ipc_handle()
        response = wire.locate_response(located)
        assert isinstance(response, kvcraft_pb2.LocateResponse)
        assert response.gpu_pool_bytes == node.gpu.pool_bytes
        locs = {loc.variant_id: loc for loc in response.variants}
        va, vb = (node.store.index.variants_of(k)[0].variant_id for k in (a, b))
        assert (locs[va].gpu_offset, locs[va].gpu_length) == node.gpu.location(va)
        assert locs[vb].gpu_length == 0 and locs[vb].length == SIZE  # host slab only

        class Slab:  # the host side, as kvclient.local.SharedSlab maps it
            def layers(self, loc):  # noqa: ANN001, ANN202
                raw = torch.frombuffer(node.host.shm.buf, dtype=torch.uint8, count=loc.length, offset=loc.offset)
                return [(raw[i * 2 * HALF : i * 2 * HALF + HALF].view(torch.float32),
                         raw[i * 2 * HALF + HALF : (i + 1) * 2 * HALF].view(torch.float32)) for i in range(LAYERS)]

        pool = GpuPool(response.gpu_ipc_handle, response.gpu_pool_bytes, opener=FakeOpener(node.driver))
        fetch = LocalFetch(None, response, Slab(), pool)
        assert fetch.tier == ["gpu", "host"]
        for key, layers in zip((a, b), fetch.layers):
            for (k, v), (sent_k, sent_v) in zip(layers, node.sent[key]):
                assert k.numpy().tobytes() == sent_k and v.numpy().tobytes() == sent_v
        del fetch, layers, k, v
    finally:
        node.close()
