"""Reads of payload files into GPU memory: kvikio with whole 4 KiB pages, POSIX fallback."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

from kvservice.tiers import disk_backend, gpu_driver
from kvservice.tiers.disk_backend import (
    ALIGN, KvikioBackend, PosixBackend, aligned_window, choose_backend)
from kvservice.tiers.gpu_driver import DeviceBuffer

from .fakes import FakeDriver, FakeKvikio


def payload_file(tmp_path: Path, size: int) -> tuple[Path, bytes]:
    data = os.urandom(size)
    path = tmp_path / "v.kv"
    path.write_bytes(data)
    return path, data


def read_back(driver, dst: DeviceBuffer, skew: int, length: int) -> bytes:  # noqa: ANN001
    out = bytearray(length)
    driver.dtoh(out, dst.ptr + skew, length)
    return bytes(out)


@pytest.mark.parametrize("offset,length", [
    (0, 3 * ALIGN + 100),  # a whole payload whose file ends mid-page
    (5000, 7000),  # starts and ends mid-page
    (ALIGN, ALIGN),  # exactly one page
    (3 * ALIGN + 10, 90),  # only inside the last partial page
    (0, 1),
])
def test_kvikio_gets_page_aligned_offsets_sizes_and_addresses(tmp_path: Path, offset: int, length: int) -> None:
    driver = FakeDriver()
    kv = FakeKvikio(driver)
    path, data = payload_file(tmp_path, 3 * ALIGN + 100)
    start, size = aligned_window(offset, length)
    dst = DeviceBuffer(driver.alloc(size), size)
    skew = KvikioBackend(kv, driver).read_into_device(path, offset, length, dst)
    assert skew == offset - start
    assert read_back(driver, dst, skew, length) == data[offset : offset + length]
    for _, n, file_offset, ptr in kv.preads:
        assert n % ALIGN == 0 and file_offset % ALIGN == 0 and ptr % ALIGN == 0
        assert file_offset + n <= len(data)  # never past the end of the file
    # Everything before the file's last partial page went through kvikio.
    whole_end = min(start + size, len(data) // ALIGN * ALIGN)
    assert sum(n for _, n, _, _ in kv.preads) == max(0, whole_end - start)


def test_kvikio_backend_refuses_unaligned_or_small_device_buffers(tmp_path: Path) -> None:
    driver = FakeDriver()
    path, _ = payload_file(tmp_path, 2 * ALIGN)
    backend = KvikioBackend(FakeKvikio(driver), driver)
    base = driver.alloc(4 * ALIGN)
    with pytest.raises(ValueError, match="aligned"):
        backend.read_into_device(path, 0, ALIGN, DeviceBuffer(base + 64, 2 * ALIGN))
    with pytest.raises(ValueError, match="aligned window needs 8192"):
        backend.read_into_device(path, 100, ALIGN, DeviceBuffer(base, ALIGN))


def test_short_file_is_an_oserror_not_garbage(tmp_path: Path) -> None:
    driver = FakeDriver()
    path, _ = payload_file(tmp_path, 1000)
    dst = DeviceBuffer(driver.alloc(2 * ALIGN), 2 * ALIGN)
    for backend in (KvikioBackend(FakeKvikio(driver), driver), PosixBackend(driver)):
        with pytest.raises(OSError, match="file ends at 1000"):
            backend.read_into_device(path, 0, 2000, dst)


def test_posix_backend_reads_into_device_memory(tmp_path: Path, driver) -> None:  # noqa: ANN001
    path, data = payload_file(tmp_path, 3 * ALIGN + 7)
    start, size = aligned_window(5000, 6000)
    dst = DeviceBuffer(driver.alloc(size), size)
    try:
        skew = PosixBackend(driver).read_into_device(path, 5000, 6000, dst)
        assert read_back(driver, dst, skew, 6000) == data[5000:11000]
    finally:
        driver.free(dst.ptr)


def install_kvikio(monkeypatch: pytest.MonkeyPatch, kv: FakeKvikio | None) -> None:
    monkeypatch.setitem(sys.modules, "kvikio", kv)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", kv.defaults if kv else None)


def test_missing_kvikio_falls_back_to_posix_with_one_log_line(monkeypatch, caplog) -> None:  # noqa: ANN001
    install_kvikio(monkeypatch, None)  # `import kvikio` raises ImportError
    with caplog.at_level(logging.INFO, logger="kvcraft"):
        backend = choose_backend("kvikio", FakeDriver())
    assert isinstance(backend, PosixBackend)
    assert len(caplog.records) == 1
    assert "kvcraft[gpu]" in caplog.records[0].getMessage()


def test_without_gds_kvikio_runs_in_compat_mode(monkeypatch, caplog) -> None:  # noqa: ANN001
    driver = FakeDriver()
    install_kvikio(monkeypatch, FakeKvikio(driver, compat_mode=True))
    with caplog.at_level(logging.INFO, logger="kvcraft"):
        backend = choose_backend("kvikio", driver)
    assert isinstance(backend, KvikioBackend) and backend.compat_mode
    assert [r.getMessage() for r in caplog.records] == [
        "disk reads into GPU memory through kvikio (compat mode: no GPUDirect Storage)"]
    install_kvikio(monkeypatch, FakeKvikio(driver, compat_mode=False))
    assert not choose_backend("kvikio", driver).compat_mode


def test_failing_kvikio_reads_fall_back_to_posix_once(tmp_path: Path, monkeypatch, caplog) -> None:  # noqa: ANN001
    driver = FakeDriver()
    kv = FakeKvikio(driver, fail="libcuda.so.1: cannot open shared object file")
    install_kvikio(monkeypatch, kv)
    backend = choose_backend("kvikio", driver)
    path, data = payload_file(tmp_path, 5 * ALIGN)
    dst = DeviceBuffer(driver.alloc(5 * ALIGN), 5 * ALIGN)
    with caplog.at_level(logging.WARNING, logger="kvcraft"):
        for _ in range(3):
            skew = backend.read_into_device(path, 0, len(data), dst)
            assert read_back(driver, dst, skew, len(data)) == data
    assert len(kv.preads) == 1  # tried once, then POSIX from then on
    assert len(caplog.records) == 1 and "libcuda.so.1" in caplog.records[0].getMessage()


def test_posix_is_the_default_and_bad_names_are_refused() -> None:
    assert isinstance(choose_backend("posix", FakeDriver()), PosixBackend)
    with pytest.raises(ValueError, match="disk_backend is 'gds'; expected one of posix, kvikio"):
        choose_backend("gds", FakeDriver())


def test_without_a_cuda_driver_there_is_one_log_line_and_no_gpu_reads(fresh_driver_state, caplog) -> None:  # noqa: ANN001
    """The real probe on this machine: on a CPU host libcuda.so.1 is missing."""
    if gpu_driver.load(0) is not None:
        pytest.skip("this host has a CUDA driver")
    gpu_driver._loaded.clear()  # noqa: SLF001 - probe again, this time under caplog
    with caplog.at_level(logging.INFO, logger="kvcraft"):
        assert disk_backend.backend_for("kvikio") is None
        assert disk_backend.backend_for("posix") is None
    assert len(caplog.records) == 1
    assert "gpu tier off, host slab not pinned, disk reads through POSIX" in caplog.records[0].getMessage()


def test_real_kvikio_reads_bit_identical(tmp_path: Path) -> None:
    """On a GPU host with `kvcraft[gpu]`: the same read through the real kvikio."""
    pytest.importorskip("kvikio")
    from .conftest import real_driver

    driver = real_driver()
    backend = choose_backend("kvikio", driver)
    assert isinstance(backend, KvikioBackend)
    path, data = payload_file(tmp_path, 3 * ALIGN + 100)
    for offset, length in ((0, len(data)), (5000, 7000)):
        start, size = aligned_window(offset, length)
        dst = DeviceBuffer(driver.alloc(size), size)
        try:
            skew = backend.read_into_device(path, offset, length, dst)
            assert read_back(driver, dst, skew, length) == data[offset : offset + length]
        finally:
            driver.free(dst.ptr)
