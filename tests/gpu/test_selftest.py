"""`kvcraft selftest`: on this CPU host it says what it skipped; with the fake device it
runs every GPU-side round trip, and a device that corrupts bytes makes it FAIL."""

from __future__ import annotations

import json
from pathlib import Path

from kvcli import selftest
from kvcli.selftest import SelfTest
from kvservice.tiers import gpu_driver

from .fakes import FakeDriver, FakeKvikio

GPU_CHECKS = {"gpu tier: put, read back (driver API pool)", "host slab pinned (cudaHostRegister) -> GPU",
              "disk -> GPU, POSIX backend", "disk -> GPU, kvikio backend"}


def test_on_a_cpu_host_it_says_what_it_skipped_and_exits_0(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "selftest.json"
    assert selftest.main(["--mib", "1", "--repeat", "1", "--no-kernels", "--dir", str(tmp_path),
                          "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    by_check = {r["check"]: r for r in report["results"]}
    assert not any(r["status"] == "FAIL" for r in report["results"])
    if gpu_driver.load(0) is None:
        for check in GPU_CHECKS:
            assert by_check[check]["status"] == "SKIP"
            assert "no CUDA driver" in by_check[check]["detail"]
        assert report["rates"] == []  # nothing measured into GPU memory without a GPU
        assert "skipped on this host" in capsys.readouterr().out


def test_with_a_device_every_gpu_round_trip_runs(tmp_path: Path) -> None:
    driver = FakeDriver()
    report = SelfTest(64 * 1024 + 100, 1, tmp_path, driver=driver, kvikio=FakeKvikio(driver)).run(with_kernels=False)
    by_check = {r.check: r for r in report.results}
    for check in GPU_CHECKS:
        assert by_check[check].status == "PASS", by_check[check]
    store = by_check["store: every tier of this host, promote, read back"]
    assert store.status == "PASS" and "tiers gpu + host + disk" in store.detail and "promoted to gpu" in store.detail
    assert {r.path for r in report.rates} >= {"host slab (pinned) -> GPU", "disk -> GPU, posix",
                                              "disk -> GPU, kvikio (compat mode)"}
    assert driver.registered == {}  # the slab was unregistered again
    assert list(driver.allocations) == []  # every device allocation freed


class CorruptingDriver(FakeDriver):
    def htod(self, dst: int, src) -> None:  # noqa: ANN001
        data = bytearray(src)
        data[len(data) // 2] ^= 0x01
        super().htod(dst, data)


def test_a_corrupting_device_fails_the_selftest(tmp_path: Path) -> None:
    driver = CorruptingDriver()
    report = SelfTest(64 * 1024, 1, tmp_path, driver=driver, kvikio=FakeKvikio(driver)).run(with_kernels=False)
    by_check = {r.check: r for r in report.results}
    assert report.failed
    assert by_check["gpu tier: put, read back (driver API pool)"].status == "FAIL"
    assert "differ" in by_check["disk -> GPU, POSIX backend"].detail


def test_kvcraft_selftest_is_a_command(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from kvcli.main import main

    assert main(["selftest", "--mib", "0.25", "--repeat", "1", "--no-kernels", "--dir", str(tmp_path)]) == 0
    assert "PASS  host + disk tiers" in capsys.readouterr().out
    assert main(["selftest", "--mib", "0"]) == 2  # bad input: a message, not a traceback
