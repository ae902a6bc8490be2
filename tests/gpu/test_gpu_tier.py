"""The gpu tier on the tier protocol: page-aligned extents in one device pool, accounting,
TierFull, reads back bit-identical, GPU-direct fills from disk checked layer by layer.
Every test taking `driver` runs on the fake device and, on a GPU host, on the real one."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvservice.tiers.base import PayloadShape, TierFull
from kvservice.tiers.disk_backend import ALIGN, KvikioBackend, PosixBackend
from kvservice.tiers.gpu import GpuTier

from .fakes import FakeDriver, FakeKvikio

SHAPE = PayloadShape(num_layers=3, layer_bytes=1000)  # 3000 bytes: one page each


def payload(shape: PayloadShape = SHAPE, seed: int = 0) -> list[bytes]:
    rnd = __import__("random").Random(seed)
    return [rnd.randbytes(shape.layer_bytes) for _ in range(shape.num_layers)]


def put(tier: GpuTier, vid: str, layers: list[bytes], shape: PayloadShape = SHAPE) -> None:
    w = tier.open_writer(vid, shape)
    for layer in layers:
        half = len(layer) // 2
        w.write_layer(layer[:half], memoryview(layer)[half:])  # K then V, as the store writes
    w.commit()


def test_layers_read_back_bit_identical(driver) -> None:  # noqa: ANN001
    tier = GpuTier(8 * ALIGN, driver)
    try:
        layers = payload()
        put(tier, "a", layers)
        assert "a" in tier
        for i, layer in enumerate(layers):
            assert bytes(tier.get_layer("a", i, SHAPE)) == layer
        assert bytes(tier.get_layers("a", 1, 2, SHAPE)) == layers[1] + layers[2]
        with pytest.raises(KeyError):
            tier.get_layer("missing", 0, SHAPE)
    finally:
        tier.close()


def test_every_variant_starts_on_a_page_and_usage_counts_whole_pages(driver) -> None:  # noqa: ANN001
    tier = GpuTier(8 * ALIGN, driver)
    try:
        for i in range(3):
            put(tier, f"v{i}", payload(seed=i))
        offsets = [tier.location(f"v{i}")[0] for i in range(3)]
        assert all(off % ALIGN == 0 for off in offsets) and len(set(offsets)) == 3
        assert all(tier.device_span(f"v{i}").ptr % ALIGN == 0 for i in range(3))
        assert tier.usage() == 3 * ALIGN  # 3000 bytes take one 4 KiB page each
        tier.delete("v1")
        tier.delete("v1")  # absent is not an error
        assert tier.usage() == 2 * ALIGN and "v1" not in tier
    finally:
        tier.close()


def test_a_full_pool_raises_tierfull_and_abort_gives_the_room_back() -> None:
    tier = GpuTier(2 * ALIGN, FakeDriver())
    put(tier, "a", payload())
    w = tier.open_writer("b", SHAPE)  # reserves the second page
    assert tier.usage() == ALIGN  # usage counts committed copies only
    with pytest.raises(TierFull, match="gpu pool has no free run of 4096 bytes"):
        tier.open_writer("c", SHAPE)
    w.abort()
    w.abort()  # twice is harmless
    assert tier.usage() == ALIGN
    put(tier, "c", payload(seed=3))
    big = PayloadShape(2, ALIGN)
    tier.delete("a")
    tier.delete("c")
    put(tier, "big", payload(big), big)  # freed pages coalesce into one run
    assert tier.usage() == 2 * ALIGN


def test_short_or_long_writes_are_refused() -> None:
    tier = GpuTier(4 * ALIGN, FakeDriver())
    w = tier.open_writer("a", SHAPE)
    w.write_layer(bytes(1000))
    with pytest.raises(ValueError, match="1000 bytes written, 3000 expected"):
        w.commit()
    with pytest.raises(ValueError, match="write past"):
        w.write_layer(bytes(2001))
    w.abort()
    assert tier.usage() == 0 and "a" not in tier


class _Disk:
    """The part of the disk tier a GPU-direct fill uses."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path_of(self, vid: str) -> Path:
        return self.root / f"{vid}.kv"


@pytest.mark.parametrize("backend_name", ["kvikio", "posix"])
def test_fill_from_disk_reads_straight_into_the_pool_and_verifies_each_layer(tmp_path: Path, backend_name) -> None:  # noqa: ANN001
    driver = FakeDriver()
    kv = FakeKvikio(driver)
    backend = KvikioBackend(kv, driver) if backend_name == "kvikio" else PosixBackend(driver)
    tier = GpuTier(8 * ALIGN, driver, backend)
    layers = payload()
    disk = _Disk(tmp_path)
    disk.path_of("a").write_bytes(b"".join(layers))
    seen: list[tuple[int, bytes]] = []
    w = tier.open_writer("a", SHAPE)
    assert w.fill_from(disk, "a", SHAPE, lambda layer, data: seen.append((layer, bytes(data))))
    w.commit()
    assert seen == list(enumerate(layers))
    assert [bytes(tier.get_layer("a", i, SHAPE)) for i in range(3)] == layers
    if backend_name == "kvikio":
        assert all(size % ALIGN == 0 and off % ALIGN == 0 for _, size, off, _ in kv.preads)


def test_a_corrupt_file_fails_the_fill_and_nothing_is_published(tmp_path: Path) -> None:
    driver = FakeDriver()
    tier = GpuTier(8 * ALIGN, driver, PosixBackend(driver))
    layers = payload()
    disk = _Disk(tmp_path)
    bad = bytearray(b"".join(layers))
    bad[1500] ^= 0xFF
    disk.path_of("a").write_bytes(bad)

    def verify(layer: int, data: memoryview) -> None:
        if bytes(data) != layers[layer]:
            raise ValueError(f"layer {layer} failed its checksum")

    w = tier.open_writer("a", SHAPE)
    with pytest.raises(ValueError, match="layer 1 failed"):
        w.fill_from(disk, "a", SHAPE, verify)
    w.abort()
    assert "a" not in tier and tier.usage() == 0


def test_fill_from_does_not_apply_without_a_backend_or_a_file_source(tmp_path: Path) -> None:
    tier = GpuTier(8 * ALIGN, FakeDriver())
    w = tier.open_writer("a", SHAPE)
    assert not w.fill_from(_Disk(tmp_path), "a", SHAPE, None)  # no disk backend
    tier2 = GpuTier(8 * ALIGN, FakeDriver(), PosixBackend(FakeDriver()))
    assert not tier2.open_writer("a", SHAPE).fill_from(tier, "a", SHAPE, None)  # a source without files


def test_ipc_handle_names_the_pool_and_close_frees_it() -> None:
    driver = FakeDriver()
    tier = GpuTier(4 * ALIGN, driver)
    base = tier.base
    assert tier.ipc_handle()[:8] == base.to_bytes(8, "little")
    tier.close()
    assert driver.freed == [base] and not driver.allocations


def test_real_ipc_handle_is_64_bytes(driver) -> None:  # noqa: ANN001
    tier = GpuTier(ALIGN, driver)
    try:
        assert len(tier.ipc_handle()) == 64
    finally:
        tier.close()
