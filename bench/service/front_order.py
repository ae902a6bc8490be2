"""How often the CRAFT front gives a chunk set the order it had before.

    kvcraft bench front-order            # default trace, 200 conversations, three passes

A prefix cache (vLLM's, or the connector's blocks) only hits when a prompt starts with
the same chunks in the same order, so a chunk set that comes back must get the order it
had. The planner (kvservice.planner, the one the Plan RPC runs) replays the trace's
first turns three times with the CP-Tree path-following on and off, side by side:

  2nd pass   the same first turns again (the issue's "identical requests"): same order as pass 1?
  3rd pass   and once more: same order as pass 2?
  seen set   within the first pass, a first turn whose chunk set an earlier first turn had.

For each: the share of those requests whose order equals the previous order of that set.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any, Sequence

from kvbench import results
from kvbench.common.args import count
from kvbench.common.workload import DEFAULT, generate
from kvservice.planner import ChunkRef, InMemoryCatalog, Planner, PlannerConfig


def first_turns(conversations: int, seed: int = 0) -> list[list[ChunkRef]]:
    cfg = replace(DEFAULT, seed=seed, conversations=conversations,
                  corpus=max(1000, int(DEFAULT.corpus * conversations / DEFAULT.conversations)))
    seen: set[str] = set()
    out = []
    for r in generate(cfg):
        if r.conv_id and r.conv_id in seen:
            continue
        seen.add(r.conv_id)
        out.append([ChunkRef(k, n) for k, n in r.chunks])
    return out


def replay(reqs: list[list[ChunkRef]], follow: bool) -> dict[str, Any]:
    catalog = InMemoryCatalog()
    planner = Planner(catalog, PlannerConfig(follow_prefix=follow))
    catalog.listeners.append(planner)
    last: dict[frozenset[str], tuple[str, ...]] = {}
    seen = seen_same = 0
    first_pass: list[tuple[str, ...]] = []
    for chunks in reqs:
        order = planner.plan("m", "", chunks, 16).order
        s = frozenset(order)
        if s in last:
            seen += 1
            seen_same += last[s] == order
        last[s] = order
        first_pass.append(order)
    second_pass = [planner.plan("m", "", chunks, 16).order for chunks in reqs]
    third_pass = [planner.plan("m", "", chunks, 16).order for chunks in reqs]
    same2 = sum(a == b for a, b in zip(first_pass, second_pass))
    same3 = sum(a == b for a, b in zip(second_pass, third_pass))
    return {"follow_prefix": follow, "requests": len(reqs), "second_pass_same_order": same2,
            "second_pass_share": same2 / len(reqs), "third_pass_same_order": same3,
            "third_pass_share": same3 / len(reqs), "seen_set_requests": seen, "seen_set_same_order": seen_same,
            "seen_set_share": seen_same / seen if seen else 0.0}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    ap = argparse.ArgumentParser(prog="kvcraft bench front-order", description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=count(), default=200, help="of the default trace's 2000")
    results.add_argument(ap, "front-order")
    a = ap.parse_args(argv)
    reqs = first_turns(a.conversations)
    rows = [replay(reqs, follow) for follow in (False, True)]
    print(f"{'CP-Tree path first':20s} {'2nd pass = 1st':>20s} {'3rd pass = 2nd':>20s} {'seen set (1st pass)':>22s}")
    for r in rows:
        print(f"{'on' if r['follow_prefix'] else 'off':20s} "
              f"{r['second_pass_same_order']:>5d}/{r['requests']:<5d} {r['second_pass_share']:6.1%}  "
              f"{r['third_pass_same_order']:>5d}/{r['requests']:<5d} {r['third_pass_share']:6.1%}  "
              f"{r['seen_set_same_order']:>5d}/{r['seen_set_requests']:<5d} {r['seen_set_share']:6.1%}")
    results.save("front-order", argv, {"conversations": a.conversations, "rows": rows}, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
