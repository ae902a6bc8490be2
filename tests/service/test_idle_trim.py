"""Freed layer buffers go back to the OS once the server is idle (kvservice/server/heap.py).

The server keeps layer-sized buffers in glibc's heap while streams run (the launcher's
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_: a fresh mmap per message made FetchLayers
2.5x slower than grpcio's own stream). Eight Stores of 8 MiB layers at once, then
fetches of what they stored, leave a few hundred MiB of freed heap behind; a second after
the last RPC the server trims it and its private memory falls back near where it started."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from kvclient.client import KVClient, Ref
from kvcraft.keys import ModelSpec

MiB = 1 << 20
LAYERS, TOKENS, STREAMS = 8, 2048, 8
MODEL = ModelSpec("trim", num_layers=LAYERS, num_kv_heads=4, head_dim=128, dtype="float32").fingerprint()
SLACK = 48 * MiB  # what may stay above the warm server's private memory once idle


def _private(pid: int) -> int:
    """Resident memory that is not the shared host slab (RssAnon)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name == "RssAnon":
            return int(rest.split()[0]) * 1024
    raise AssertionError("no RssAnon in /proc/PID/status")


def _layers(i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    base = torch.randn(4, TOKENS, 128, generator=torch.Generator().manual_seed(i))
    return [(base + layer, base - layer) for layer in range(LAYERS)]


def test_freed_layer_buffers_return_to_the_os_once_idle(start_server):
    server = start_server(host_budget_bytes=64 * MiB)
    with KVClient(server.address, max_message_bytes=64 * MiB) as c:  # warm: imports, slab, RocksDB
        c.stats()
    before = _private(server.proc.pid)
    keys: list[str] = [""] * STREAMS
    errors: list[BaseException] = []

    def store_and_fetch(i: int) -> None:
        try:
            with KVClient(server.address, max_message_bytes=64 * MiB) as c:
                keys[i] = c.store(MODEL, [i * 10_000 + t for t in range(TOKENS)], _layers(i)).chunk_key
                got = list(c.fetch_layers([Ref(keys[i])]))
                assert [torch.equal(f.key, k) and torch.equal(f.value, v) for f, (k, v) in zip(got, _layers(i))] \
                    == [True] * LAYERS
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=store_and_fetch, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    peak = before
    while any(t.is_alive() for t in threads):
        peak = max(peak, _private(server.proc.pid))
        time.sleep(0.05)
    assert not errors, errors
    assert peak - before > 2 * SLACK, f"the streams used only {(peak - before) / MiB:.0f} MiB: nothing to trim"
    deadline = time.monotonic() + 15  # idle 1 s, then the trim; generous for a loaded machine
    while _private(server.proc.pid) - before > SLACK and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _private(server.proc.pid) - before
    assert left <= SLACK, f"{left / MiB:.0f} MiB of private memory stayed after the streams (peak +{(peak - before) / MiB:.0f})"
