"""Choosing eviction victims with N variants stored: the store's per-tier eviction order
(`Placement.lowest`) beside a scan and sort of every variant (the plain policy, which
the store ran until 2026-11-24), in one run.

Variants are metadata only, entered into the disk tier's membership (no payload files:
what is timed is the choice, which runs with the store's lock held, so every Plan,
Lease and fetch start waits behind it). Keys are spread (random fr and last access).
Between two victims, 5 random chunks are reused (fr += 1), which leaves entries behind
their variant's key: the order must put those right as it goes. Each victim is checked
against the scan's choice for the first victims, then dropped from the tier.

A second table times deleting a victim once chosen (its payload file, then its metadata,
with the store's lock held), on real payload files in the data directory's filesystem:
with the metadata delete synced (as until 2026-11-24) and unsynced (as evictions do
now), alternating victims.

    kvcraft bench eviction --sizes 16000 100000 1000000 --data-dir /var/tmp
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

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
            "ours_p50_us": round(statistics.median(ours_s) * 1e6, 1),
            "ours_max_us": round(max(ours_s) * 1e6, 1), "victims": victims}


def measure_delete(victims: int, parent: str | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvcraft-delete-", dir=parent) as tmp:
        store = ChunkStore(load_config(env={}, overrides={"data_dir": tmp}))
        spec = Spec(pb.FLOAT16, (8, 16, 128))
        vids = []
        for i in range(victims):
            s = store.begin_store(StoreHeader(MODEL, [i, 1, 2] + [0] * 13, (), 2, spec, spec))
            for layer in range(2):
                s.add_layer(layer, bytes(8 * 16 * 128 * 2), bytes(8 * 16 * 128 * 2))
            vids.append(s.finish().variant_id)
        times: dict[bool, list[float]] = {True: [], False: []}
        for i, vid in enumerate(vids):
            sync = i % 2 == 0
            t = time.perf_counter()
            with store._s.lock:
                store._placement.delete_many([vid], sync=sync)
            times[sync].append(time.perf_counter() - t)
        if len(store.index):
            raise AssertionError(f"{len(store.index)} variants left after deleting every one")
        store.close()
    return {"victims": victims, "synced_p50_ms": round(statistics.median(times[True]) * 1e3, 3),
            "unsynced_p50_ms": round(statistics.median(times[False]) * 1e3, 3),
            "synced_max_ms": round(max(times[True]) * 1e3, 3), "unsynced_max_ms": round(max(times[False]) * 1e3, 3)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvcraft bench eviction")
    p.add_argument("--sizes", type=int, nargs="+", default=[16_000, 100_000, 1_000_000])
    p.add_argument("--victims", type=int, default=1000)
    p.add_argument("--deletes", type=int, default=400, help="victims deleted for the second table")
    p.add_argument("--data-dir", help="where the second table's payload files go (default: the temp dir)")
    p.add_argument("--json", default="bench-eviction.json")
    a = p.parse_args(argv)
    print(f"{'variants':>10} {'fill s':>7} {'scan + sort ms':>15} {'ours p50 µs':>12} {'ours max µs':>12}", flush=True)
    rows = []
    for n in a.sizes:
        r = measure(n, a.victims)
        rows.append(r)
        print(f"{r['variants']:>10} {r['fill_s']:>7} {r['scan_ms']:>15} {r['ours_p50_us']:>12} {r['ours_max_us']:>12}",
              flush=True)
    d = measure_delete(a.deletes, a.data_dir)
    print(f"\ndeleting a victim (payload + metadata), {d['victims']} alternating:")
    print(f"{'metadata':>10} {'p50 ms':>8} {'max ms':>8}")
    print(f"{'synced':>10} {d['synced_p50_ms']:>8} {d['synced_max_ms']:>8}")
    print(f"{'unsynced':>10} {d['unsynced_p50_ms']:>8} {d['unsynced_max_ms']:>8}", flush=True)
    Path(a.json).write_text(json.dumps({"victims": rows, "delete": d}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
