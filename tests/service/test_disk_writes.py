"""How the disk tier puts a payload into the page cache (kvservice.tiers.disk)."""

from __future__ import annotations

import os

from kvservice.tiers.base import PayloadShape
from kvservice.tiers.disk import DiskTier

MIB = 1 << 20


def test_layers_go_out_in_writes_under_2_mib_and_survive_short_writes(tmp_path, monkeypatch):
    """A write of 2 MiB or more gets 2 MiB page-cache folios (Linux 6.x), which on a VM
    that reports free memory to its host must fault in again page by page (5x slower on
    the project's VM: docs/benchmarks.md, "Store and the page cache"). Every write the
    tier makes stays under that, and the file still holds every byte in order when the
    kernel takes only part of a write."""
    k = bytes(range(256)) * (6 * 1024 + 1)  # 1.5 MiB + 256: not a multiple of a write
    v = bytes(reversed(range(256))) * (9 * 1024 + 3)  # 2.25 MiB + 768
    layers = [(k, v), (v, k)]
    sizes: list[int] = []
    real_write, real_writev = os.write, os.writev

    def write(fd: int, data) -> int:  # noqa: ANN001 - a buffer
        sizes.append(len(data))
        short = len(sizes) % 3 == 0  # every third write: the kernel takes half of it
        return real_write(fd, memoryview(data)[: max(1, len(data) // 2)] if short else data)

    def writev(fd: int, buffers) -> int:  # noqa: ANN001 - buffers
        sizes.append(sum(len(b) for b in buffers))
        return real_writev(fd, buffers)

    tier = DiskTier(tmp_path, 1 << 30)
    shape = PayloadShape(len(layers), len(k) + len(v))
    writer = tier.open_writer("ab" * 16, shape)
    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "writev", writev)
    for kk, vv in layers:
        writer.write_layer(kk, vv)
    monkeypatch.undo()
    writer.commit()

    assert sizes and max(sizes) < 2 * MIB
    assert sum(sizes) >= shape.total_bytes  # every byte went through a counted write
    for layer, (kk, vv) in enumerate(layers):
        assert bytes(tier.get_layer("ab" * 16, layer, shape)) == kk + vv
