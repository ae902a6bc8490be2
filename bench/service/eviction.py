"""Choosing eviction victims with N variants stored: the store's per-tier eviction order
(`Placement.lowest`) beside a scan and sort of every variant (the plain policy, the
baseline the order must beat), in one run.

Variants are metadata only, entered into the disk tier's membership (no payload files:
what is timed is the choice, which runs with the store's lock held, so every Plan,
Lease and fetch start waits behind it). Keys are spread (random fr and last access).
Between two victims, 5 random chunks are reused (fr += 1), which leaves entries behind
their variant's key: the order must put those right as it goes. Each victim is checked
against the scan's choice for the first victims, then dropped from the tier.

A second table times deleting a victim once chosen (its payload file, then its metadata,
with the store's lock held), on real payload files just written (as a full disk's
newest variants are): the plain way (unlink the file, synced metadata delete) beside
the store's own (rename the file aside for a reaper thread, unsynced metadata delete),
alternating victims.

    kvcraft bench eviction --sizes 16000 100000 1000000 --data-dir /var/tmp
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from kvbench import results, stats
from kvbench.common.args import count
from kvcraft.keys import ModelSpec, chunk_key, variant_id
from kvcraft.layout import layer_layout
from kvcraft.records import VariantStats
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.config import load_config
from kvservice.index import Spec, Variant, eviction_key
from kvservice.records import StoreHeader
from kvservice.store import ChunkStore

MODEL = ModelSpec("llama3-8b", 32, 8, 128, "bfloat16", 500000.0).fingerprint()
TOKENS = 512
CHECKED = 50  # victims compared with the scan's choice


def _fill(store: ChunkStore, n: int, rng: random.Random) -> list[str]:
    s = store._s
    index, disk = s.index, s.tiers[s.home]
    spec = index.intern_spec(Spec(pb.BFLOAT16, (8, TOKENS, 128)))
    layout = index.intern_layout(layer_layout(spec, spec, TOKENS))
    keys = []
    for i in range(n):
        key = chunk_key(MODEL, [i, 7, 7])
        keys.append(key)
        v = Variant(variant_id(key, ()), key, (), TOKENS, disk.name, VariantStats(), range(TOKENS), model_id=MODEL,
                    num_layers=32, key_spec=spec, value_spec=spec, layout=layout, layer_checksums=tuple(range(32)),
                    fr=rng.random() * 10, last_access_ms=rng.randrange(10**9), created_ms=0)
        index.add(v)
        disk._held.add(v.variant_id)  # as if its payload file were there
    s.rebuild_eviction_order()  # as recovery does
    return keys


def _scan(store: ChunkStore) -> Variant:
    """The plain policy: every variant the tier holds, unprotected, sorted by key."""
    s = store._s
    disk = s.tiers[s.home]
    return sorted((v for v in s.index if v.variant_id in disk and not v.protected), key=eviction_key)[0]


def measure(n: int, victims: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="kvcraft-evict-") as tmp:
        store = ChunkStore(load_config(env={}, overrides={"data_dir": tmp, "max_variants": 2 * n}))
        gc.disable()
        t0 = time.perf_counter()
        keys = _fill(store, n, rng)
        fill_s = time.perf_counter() - t0
        s = store._s
        disk = s.tiers[s.home]
        scan_s = []
        for _ in range(3):
            t = time.perf_counter()
            _scan(store)
            scan_s.append(time.perf_counter() - t)
        ours_s = []
        for i in range(victims):
            want = _scan(store) if i < CHECKED else None
            t = time.perf_counter()
            v = store._placement.lowest(s.home)
            ours_s.append(time.perf_counter() - t)
            if want is not None and v is not want:
                raise AssertionError(f"victim {i}: the order chose {v.variant_id}, the scan {want.variant_id}")
            disk._held.discard(v.variant_id)
            for k in rng.sample(keys, 5):
                for w in s.index.variants_of(k):
                    w.fr += 1.0
        gc.enable()
        store.close()
    return {"variants": n, "fill_s": round(fill_s, 1), "scan_ms": round(statistics.median(scan_s) * 1e3, 1),
            **stats.summary(ours_s, prefix="ours_", unit="_us", scale=1e6, digits=1),
            "ours_max_us": round(max(ours_s) * 1e6, 1), "victims": victims}


def measure_delete(victims: int, mib: int, parent: str | None) -> dict:
    """Delete `victims` real variants of `mib` MiB each, one by one with the store's lock
    held, alternating a baseline (unlink in place, synced metadata delete) with the
    store's own way (`Placement.delete`)."""
    layers = max(1, mib // 2)
    spec = Spec(pb.FLOAT16, (8, 512, 128))  # K or V of one layer: 1 MiB
    with tempfile.TemporaryDirectory(prefix="kvcraft-delete-", dir=parent) as tmp:
        store = ChunkStore(load_config(env={}, overrides={"data_dir": tmp, "host_budget_bytes": 1 << 20}))
        layer = bytes(8 * 512 * 128 * 2)
        vids = []
        for i in range(victims):
            s = store.begin_store(StoreHeader(MODEL, [i, 1, 2] + [0] * 509, (), layers, spec, spec))
            for n in range(layers):
                s.add_layer(n, layer, layer)
            vids.append(s.finish().variant_id)
        disk = store.tiers[store._s.home]
        times: dict[str, list[float]] = {"before": [], "now": []}
        for i, vid in enumerate(vids):
            t = time.perf_counter()
            with store._s.lock:
                if i % 2 == 0:
                    disk.path_of(vid).unlink()
                    store._placement.delete_many([vid])
                    store._s.meta.sync()
                else:
                    store._placement.delete(vid)
            times["before" if i % 2 == 0 else "now"].append(time.perf_counter() - t)
        if len(store.index):
            raise AssertionError(f"{len(store.index)} variants left after deleting every one")
        store.close()  # the reaper unlinks what is left
        left = list(Path(tmp, "payloads").rglob("*.kv*"))
        if left:
            raise AssertionError(f"{len(left)} payload files left behind, e.g. {left[0]}")
    out = {"victims": victims, "mib": layers * 2}
    for way, t in times.items():
        out |= stats.summary(t, prefix=f"{way}_", unit="_ms", scale=1e3, digits=3)
        out[f"{way}_max_ms"] = round(max(t) * 1e3, 3)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    p = argparse.ArgumentParser(prog="kvcraft bench eviction", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=count(), nargs="+", default=[16_000, 100_000, 1_000_000])
    p.add_argument("--victims", type=count(), default=1000)
    p.add_argument("--deletes", type=count(0), default=100, help="victims deleted for the second table")
    p.add_argument("--delete-mib", type=count(), default=8, help="payload size of those victims")
    p.add_argument("--data-dir", help="where the second table's payload files go (default: the temp dir)")
    results.add_argument(p, "eviction")
    a = p.parse_args(argv)
    print(f"{'variants':>10} {'fill s':>7} {'scan + sort ms':>15} {'ours p50 µs':>12} {'ours max µs':>12}", flush=True)
    rows = []
    for n in a.sizes:
        r = measure(n, a.victims)
        rows.append(r)
        print(f"{r['variants']:>10} {r['fill_s']:>7} {r['scan_ms']:>15} {r['ours_p50_us']:>12} {r['ours_max_us']:>12}",
              flush=True)
    d = measure_delete(a.deletes, a.delete_mib, a.data_dir)
    print(f"\ndeleting a victim of {d['mib']} MiB with the store's lock held, {d['victims']} alternating:")
    print(f"{'way':>40} {'p50 ms':>8} {'max ms':>8}")
    print(f"{'unlink + synced metadata delete':>40} {d['before_p50_ms']:>8} {d['before_max_ms']:>8}")
    print(f"{'rename aside + unsynced (the store)':>40} {d['now_p50_ms']:>8} {d['now_max_ms']:>8}", flush=True)
    results.save("eviction", argv, {"victims": rows, "delete": d}, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
