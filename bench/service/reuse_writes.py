"""What a fetch's bookkeeping costs the store: `open_fetch` + `close_fetch` of a request's
variants (resolve, hold, count the reuse, persist the new fr and last access, let go),
all with the store's lock held, so every Plan, Lease and fetch start waits behind it.

Two ways to persist the scores, side by side in one run, rounds alternating:
  access   a 16-byte access record per reused variant (`MetadataDB.put_access`, the store's way)
  record   the whole VariantInfo per reused variant (the alternative): its size grows
           with the per-token statistics

Each request fetches 5 chunks stored behind one another (Cache-Craft statistics: one
inter-attention value per token), written with RocksDB as the service does (unsynced).
Each round checks that what the store wrote reads back as the scores it holds.

    kvcraft bench reuse-writes --tokens 128 512 2048
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from typing import Sequence

from kvbench import results, stats
from kvbench.common.args import count
from kvcraft.keys import ModelSpec
from kvcraft.records import Ref, VariantStats
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.config import load_config
from kvservice.index import Spec
from kvservice.records import StoreHeader
from kvservice.store import ChunkStore

MODEL = ModelSpec("llama-ish", 2, 4, 64, "float16").fingerprint()
CHUNKS = 5
WAYS = ("access", "record")


def _fill(store: ChunkStore, tokens: int, rng: random.Random) -> list[Ref]:
    spec = Spec(pb.FLOAT16, (4, tokens, 64))
    refs: list[Ref] = []
    prefix: tuple[str, ...] = ()
    for _ in range(CHUNKS):
        ids = [rng.randrange(32000) for _ in range(tokens)]
        stats = VariantStats(0.1 if prefix else 0.0, 0.5, tuple(0.1 for _ in prefix),
                             tuple(rng.random() for _ in range(tokens)) if prefix else ())
        s = store.begin_store(StoreHeader(MODEL, ids, prefix, 2, spec, spec, stats))
        for layer in range(2):
            s.add_layer(layer, bytes(4 * tokens * 64 * 2), bytes(4 * tokens * 64 * 2))
        r = s.finish()
        refs.append(Ref(r.chunk_key, r.variant_id, 0.5))
        prefix += (r.chunk_key,)
    return refs


def _round(store: ChunkStore, refs: list[Ref], fetches: int) -> list[float]:
    out = []
    for _ in range(fetches):
        t = time.perf_counter_ns()
        vs = store.open_fetch(refs)
        store.close_fetch(vs, promote=False)
        out.append((time.perf_counter_ns() - t) / 1e3)
    return out


def _written(store: ChunkStore, way: str) -> dict[str, float]:
    meta = store._s.meta
    if way == "access":
        return {vid: fr for vid, (fr, _) in meta.load_access().items()}
    return {vid: v.fr for vid, v in meta.load_variants() if v is not None}


def measure(tokens: int, fetches: int, rounds: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    with tempfile.TemporaryDirectory(prefix="kvcraft-reuse-") as tmp:
        stores = {}
        for way in WAYS:
            store = ChunkStore(load_config(env={}, overrides={"data_dir": f"{tmp}/{way}"}))
            if way == "record":
                meta = store._s.meta
                meta.put_access = lambda vs, meta=meta: meta.put_variants(vs, sync=False)
            stores[way] = (store, _fill(store, tokens, rng))
        for _ in range(rounds):
            for way in WAYS:
                store, refs = stores[way]
                times[way] += _round(store, refs, fetches)
                held = {v.variant_id: v.fr for v in store.index}
                if _written(store, way) != held:
                    raise AssertionError(f"{way}: what was written is not the scores the store holds")
        store, refs = stores["record"]
        record_bytes = max(len(store._s.meta._variants[r.variant_id.encode()]) for r in refs)
        for store, _ in stores.values():
            store.close()
    row = {"tokens": tokens, "chunks": CHUNKS, "fetches": fetches * rounds, "record_bytes": record_bytes}
    for way in WAYS:
        row |= stats.summary(times[way], prefix=f"{way}_", unit="_us", digits=1)
    return row


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    p = argparse.ArgumentParser(prog="kvcraft bench reuse-writes", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=count(), nargs="+", default=[128, 512, 2048], help="tokens per chunk")
    p.add_argument("--fetches", type=count(), default=500, help="per round and way")
    p.add_argument("--rounds", type=count(), default=6)
    results.add_argument(p, "reuse-writes")
    a = p.parse_args(argv)
    print(f"{'tokens':>7} {'record B':>9} {'access p50 µs':>14} {'p99':>7} {'record p50 µs':>14} {'p99':>7}", flush=True)
    rows = []
    for n in a.tokens:
        r = measure(n, a.fetches, a.rounds)
        rows.append(r)
        print(f"{r['tokens']:>7} {r['record_bytes']:>9} {r['access_p50_us']:>14} {r['access_p99_us']:>7} "
              f"{r['record_p50_us']:>14} {r['record_p99_us']:>7}", flush=True)
    results.save("reuse-writes", argv, {"rows": rows}, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
