"""A same-host engine maps the service's gpu pool by its IPC handle and reads a variant's
layers in place (kvclient.gpu_pool); the layout matches what the gpu tier stored."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from kvclient.gpu_pool import GpuPool, layer_views
from kvservice.tiers.base import PayloadShape
from kvservice.tiers.gpu import GpuTier

from .fakes import FakeDriver

KEY = (torch.float32, (2, 5, 4))  # [kv_heads, tokens, head_dim]
VALUE = (torch.float16, (2, 5, 4))


class FakeOpener:
    """Opens a FakeDriver allocation by the handle the fake driver made for it."""

    def __init__(self, driver: FakeDriver) -> None:
        self.driver = driver
        self.closed = False

    def open(self, handle: bytes, nbytes: int, device: int) -> torch.Tensor:
        base = int.from_bytes(handle[:8], "little")
        return torch.frombuffer(self.driver.allocations[base], dtype=torch.uint8, count=nbytes)

    def close(self, pool: torch.Tensor) -> None:
        self.closed = True


def stored_layers(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(*KEY[1], generator=g), torch.randn(*VALUE[1], generator=g).half()) for _ in range(n)]


def test_engine_reads_the_variant_in_place_from_the_mapped_pool() -> None:
    driver = FakeDriver()
    tier = GpuTier(1 << 16, driver)
    layers = stored_layers(3)
    layer_bytes = sum(t.numel() * t.element_size() for t in layers[0])
    for vid in ("other", "v"):
        w = tier.open_writer(vid, PayloadShape(3, layer_bytes))
        for k, v in layers:
            w.write_layer(k.numpy().tobytes(), v.numpy().tobytes())
        w.commit()
    pool = GpuPool(tier.ipc_handle(), tier.pool_bytes, opener=FakeOpener(driver))
    off, length = tier.location("v")
    got = pool.layers(off, length, 3, KEY, VALUE)
    for (k, v), (gk, gv) in zip(layers, got, strict=True):
        assert torch.equal(gk, k) and torch.equal(gv, v)
    # aliasing, not a copy: a byte changed in the pool shows through
    driver.allocations[tier.base][off] ^= 0xFF
    assert not torch.equal(got[0][0], layers[0][0])
    with pytest.raises(ValueError, match="outside the"):
        pool.layers(tier.pool_bytes - 8, 16, 1, KEY, VALUE)
    pool.close()


def test_specs_that_do_not_match_the_bytes_are_refused() -> None:
    with pytest.raises(ValueError, match="do not hold 2 layers"):
        layer_views(torch.zeros(100, dtype=torch.uint8), 2, KEY, VALUE)


def test_real_ipc_from_another_process() -> None:
    """On a GPU host: the pool is exported here and opened in a child process (CUDA IPC
    handles cannot be opened by the process that exported them)."""
    from .conftest import real_driver

    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    driver = real_driver()
    tier = GpuTier(1 << 20, driver)
    data = bytes(range(256)) * 16
    w = tier.open_writer("v", PayloadShape(1, len(data)))
    w.write_layer(data)
    w.commit()
    off, length = tier.location("v")
    child = textwrap.dedent(f"""
        import torch
        from kvclient.gpu_pool import GpuPool
        pool = GpuPool(bytes.fromhex("{tier.ipc_handle().hex()}"), {tier.pool_bytes})
        got = pool.raw[{off}:{off + length}].cpu().numpy().tobytes()
        assert got == bytes(range(256)) * 16, "bytes differ"
        pool.close()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    tier.close()
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
