"""Fixtures for the GPU path: every test that takes `driver` runs twice, against the
fake device (always) and against the real CUDA driver (skipped where there is none),
so the same assertions prove the code on CPU and, bit for bit, on a GPU host."""

from __future__ import annotations

import pytest

from kvservice.tiers import gpu_driver

from .fakes import FakeDriver


def real_driver() -> gpu_driver.CudaDriver:
    drv = gpu_driver.load(0)
    if drv is None:
        pytest.skip(f"needs a CUDA driver ({gpu_driver.unavailable_reason()})")
    return drv


@pytest.fixture(params=["fake", "cuda"])
def driver(request: pytest.FixtureRequest):
    return FakeDriver() if request.param == "fake" else real_driver()


@pytest.fixture
def fresh_driver_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget which drivers this process loaded, so load() probes (and logs) again."""
    monkeypatch.setattr(gpu_driver, "_loaded", {})
    monkeypatch.setattr(gpu_driver, "_reason", None)
