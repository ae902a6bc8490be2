"""Hit rate against cache capacity, per eviction order: the share of retrieved chunk tokens a
cache of C tokens holds when a request asks for them, on the synthetic RAG trace.

    kvcraft bench hit-rate [--preset default|high-reuse] [--capacities 0.05 0.1 0.2 0.4 0.8]  (both presets)

The trace is `kvbench.common.workload`'s (Zipf chunk popularity, multi-turn conversations;
`--requests` keeps its first N). Every retrieved chunk is looked up in the cache: found, it
is a hit of its tokens and it is reused (its fr grows by 1, its last access is now); missing,
it is stored, and the cache evicts in its order until the newcomer fits (a chunk larger than
the cache is not stored). One variant per chunk: what is compared is the eviction order, not
which variant a Plan picks. The orders:

  fr (the store's)  lowest (fr, last access, created, id) first: `kvservice.index.eviction_key`,
                    the order the store's tiers evict in (Cache-Craft §3.3); each reuse adds
                    1/CFO to fr, 1 here (a variant without statistics: CFO unknown)
  lru               least recently accessed first
  fifo              stored earliest first

Capacity is a share of the trace's distinct chunk tokens (its working set): at 100% nothing
is evicted and every order hits what was seen before (the compulsory misses remain).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Callable, Sequence

from sortedcontainers import SortedList

from kvbench import results
from kvbench.common.args import count
from kvbench.common.workload import PRESETS, Request, generate
from kvcraft.records import VariantStats
from kvservice.index import Variant, eviction_key

Order = Callable[[Variant], tuple]
ORDERS: dict[str, Order] = {
    "fr (the store's)": eviction_key,
    "lru": lambda v: (v.last_access_ms, v.created_ms, v.variant_id),
    "fifo": lambda v: (v.created_ms, v.variant_id),
}
CAPACITIES = (0.05, 0.1, 0.2, 0.4, 0.8)


def working_set(trace: Sequence[Request]) -> int:
    """Distinct chunk tokens of the trace."""
    return sum(dict(c for r in trace for c in r.chunks).values())


def replay(trace: Sequence[Request], capacity: int, order: Order) -> dict[str, int]:
    """Tokens retrieved, tokens hit and evictions of a cache of `capacity` tokens evicting in `order`."""
    held: dict[str, Variant] = {}
    queue = SortedList(key=order)  # what goes first at its head
    used = retrieved = hit = evictions = 0
    now = 0
    for r in trace:
        for key, tokens in r.chunks:
            now += 1
            retrieved += tokens
            v = held.get(key)
            if v is not None:
                hit += tokens
                queue.remove(v)
                v.fr += 1.0
                v.last_access_ms = now
                queue.add(v)
                continue
            if tokens > capacity:
                continue
            while used + tokens > capacity:
                gone = queue.pop(0)
                del held[gone.chunk_key]
                used -= gone.token_count
                evictions += 1
            v = Variant(key, key, (), tokens, "disk", VariantStats(), range(0), created_ms=now, last_access_ms=now)
            held[key] = v
            queue.add(v)
            used += tokens
    return {"retrieved_tokens": retrieved, "hit_tokens": hit, "evictions": evictions}


def measure(trace: Sequence[Request], capacities: Sequence[float]) -> list[dict]:
    total = working_set(trace)
    rows = []
    for share in capacities:
        for name, order in ORDERS.items():
            got = replay(trace, int(share * total), order)
            rows.append({"order": name, "capacity_share": share, "capacity_tokens": int(share * total), **got,
                         "hit_rate": got["hit_tokens"] / got["retrieved_tokens"]})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    p = argparse.ArgumentParser(prog="kvcraft bench hit-rate", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), action="append", help="trace preset(s); default: both")
    p.add_argument("--seed", type=count(0), default=0)
    p.add_argument("--conversations", type=count(), help="override the presets' conversation count")
    p.add_argument("--capacities", type=float, nargs="+", default=list(CAPACITIES),
                   help="cache sizes, as shares of the trace's distinct chunk tokens")
    results.add_argument(p, "hit-rate")
    a = p.parse_args(argv)
    traces = []
    for preset in a.preset or ["default", "high-reuse"]:
        cfg = replace(PRESETS[preset], seed=a.seed)
        if a.conversations:
            cfg = replace(cfg, conversations=a.conversations)
        trace = generate(cfg)
        rows = measure(trace, a.capacities)
        traces.append({"preset": preset, "requests": len(trace), "working_set_tokens": working_set(trace),
                       "rows": rows})
        print(f"{preset} trace: {len(trace)} requests, {working_set(trace):,} distinct chunk tokens; hit rate:")
        print(f"{'capacity':>9} " + " ".join(f"{name:>18}" for name in ORDERS))
        for i in range(0, len(rows), len(ORDERS)):
            group = rows[i:i + len(ORDERS)]
            print(f"{group[0]['capacity_share']:>9.0%} " + " ".join(f"{r['hit_rate']:>18.1%}" for r in group))
    results.save("hit-rate", argv, {"seed": a.seed, "traces": traces}, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
