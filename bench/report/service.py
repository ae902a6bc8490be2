"""Results views of the service benchmarks (kvbench.service): each renders one benchmark's
results file as docs/benchmarks.md shows it."""

from __future__ import annotations

from kvbench.report.markdown import num, pct, sources, table

Named = list[tuple[str, dict]]
POLICY_NAMES = {"no-cache": "no cache (full prefill)", "prefix-caching": "prefix caching", "craft": "CRAFT",
                "cache-craft": "Cache-Craft", "craft+cache-craft": "CRAFT + Cache-Craft",
                "oracle": "oracle (every duplicate dropped, every seen chunk reused at the planned share)"}


def planner(named: Named) -> str:
    (_, r), = named
    traces = r["traces"]
    stats = table(["trace", "requests", "seen before", "prefix-aligned", "conv. duplicates (all turns)",
                   "(later turns)"],
                  [[t, f"{int(v['stats']['requests']):,}", pct(v["stats"]["seen_before"]),
                    pct(v["stats"]["prefix_aligned"]), pct(v["stats"]["conv_dup_all_turns"]),
                    pct(v["stats"]["conv_dup_later_turns"])] for t, v in traces.items()])
    shares = table(["policy", *traces], [[POLICY_NAMES.get(p, p), *(pct(v["computed_share"][p]) for v in
                                                                     traces.values())]
                                         for p in next(iter(traces.values()))["computed_share"]])
    return f"{stats}\n\n{shares}\n\n{sources(named)}"


def plan_latency(named: Named) -> str:
    (_, r), = named
    out = []
    for row in r["rows"]:
        def cell(prefix: str) -> list[str]:
            return [num(row[f"{prefix}p50_us"]), num(row[f"{prefix}p99_us"])]
        out.append(table(["µs, " + f"{row['variants']:,} variants, n = {row['in_process_n']:,} a row", "p50", "p99"],
                         [["planner (`Planner.plan`), wall", *cell("in_process_")],
                          ["planner, thread CPU", *cell("in_process_cpu_")],
                          ["service (`PlanningService.plan`), thread CPU", *cell("service_cpu_")],
                          ["the same, 10,000 leases held", *cell("service_cpu_held_leases_")],
                          ["unary Plan RPC", *cell("grpc_")],
                          ["`KVClient.plan` (PlanStream)", *cell("blocking_")],
                          ["`AsyncKVClient.plan` (PlanStream)", *cell("stream_")],
                          ["no-op unary call (the floor)", *cell("floor_")]]))
        out.append(f"Server peak RSS {row['server_peak_rss_gb']:.2f} GB; index filled in {row['fill_s']} s; load "
                   f"average {row['load_avg']}; calibration loop {row['calib_ms']} ms (spread {row['calib_spread']}x).")
    return "\n\n".join(out) + f"\n\n{sources(named)}"


def eviction(named: Named) -> str:
    (_, r), = named
    victims = table(["variants", "fill s", "scan + sort, per victim", "store p50 per victim", "store p99",
                     "store max", "victims"],
                    [[f"{v['variants']:,}", v["fill_s"], f"{num(v['scan_ms'])} ms", f"{v['ours_p50_us']} µs",
                      f"{v['ours_p99_us']} µs", f"{v['ours_max_us']} µs", v["victims"]] for v in r["victims"]])
    d = r["delete"]
    delete = table(["payload", "deletes each", "unlink + synced metadata delete: p50 / max", "the store's (rename "
                    "aside, unsynced): p50 / max"],
                   [[f"{d['mib']} MiB", d["now_n"], f"{d['before_p50_ms']} / {d['before_max_ms']} ms",
                     f"{d['now_p50_ms']} / {d['now_max_ms']} ms"]])
    return f"{victims}\n\n{delete}\n\n{sources(named)}"


def hit_rate(named: Named) -> str:
    (_, r), = named
    out = []
    for t in r["traces"]:
        orders = list(dict.fromkeys(row["order"] for row in t["rows"]))
        shares = list(dict.fromkeys(row["capacity_share"] for row in t["rows"]))
        by = {(row["capacity_share"], row["order"]): row for row in t["rows"]}
        out.append(table([f"{t['preset']} trace: capacity (of {t['working_set_tokens']:,} tokens)", *orders],
                         [[pct(s, 0), *(pct(by[s, o]["hit_rate"]) for o in orders)] for s in shares]))
    return "\n\n".join(out) + f"\n\n{sources(named)}"


def reuse_writes(named: Named) -> str:
    (_, r), = named
    rows = [[f"{x['tokens']:,}", f"{x['record_bytes']:,}", x["access_n"], f"{x['access_p50_us']} / {x['access_p99_us']}",
             f"{x['record_p50_us']} / {x['record_p99_us']}"] for x in r["rows"]]
    return table(["tokens per chunk", "VariantInfo bytes", "fetches", "access record: p50 / p99 µs",
                  "whole record: p50 / p99 µs"], rows) + f"\n\n{sources(named)}"


def crash(named: Named) -> str:
    rows = [[f"`--rounds {r['rounds']} --seed {r['seed']}`", r["kills"], r["acked_stores"], r["acked_evicts"],
             r["in_flight_at_kill"], r["in_flight_found_complete"], f"{r['verified_fetches']:,}", len(r["violations"])]
            for _, r in named]
    return table(["run", "kills", "acknowledged stores", "acknowledged evicts", "in flight at a kill",
                  "of those, found complete", "verified fetches", "violations"], rows) + f"\n\n{sources(named)}"


FETCH_LIMITS = {"grpc-stream": "grpc-raw", "shm-local": "memcpy-limit", "store-client": "write-fsync",
                "store-grpc": "write-fsync"}


def fetch(named: Named) -> str:
    (_, r), = named
    out = []
    for server, rows in r["servers"].items():
        lines = []
        for x in rows:
            limit = FETCH_LIMITS.get(x["path"])
            lo, hi = x.get("vs_limit_range", (None, None))
            lines.append([f"`{x['path']}`", f"`{limit}`" if limit else "-", x["GB_per_s"],
                          f"{x['vs_limit']:.2f}x ({lo:.2f}-{hi:.2f})" if limit and "vs_limit" in x else "-"])
        head = f"path ({server})" if len(r["servers"]) > 1 else "path"
        out.append(table([head, "its limit", "GB/s", "x its limit: median (min-max) of the repeats"], lines))
    size = rows[0]["bytes"] / 2**20
    return "\n\n".join(out) + (f"\n\n{r['chunks']} chunks x {r['tokens']} tokens of Llama-3-8B KV (bf16), "
                               f"{size:.0f} MiB; best of {r['repeat']} repeats.\n\n{sources(named)}")


def load(named: Named) -> str:
    (_, r), = named
    rpcs = list(r["mix"])
    rows = []
    for x in r["rows"]:
        cells = [f"{num(x['rpc'][k]['p50_ms'], 0)} / {num(x['rpc'][k]['p99_ms'], 0)} ({x['rpc'][k]['n']:,})"
                 if k in x["rpc"] else "-" for k in rpcs]
        rows.append([x["clients"], num(x["ops_per_s"], 0), *cells, f"{x['rss_peak_mib']:.0f}", sum(x["errors"].values())])
    mix = ", ".join(f"{k} {v}%" for k, v in r["mix"].items())
    return (table(["clients", "ops/s", *(f"{k} p50 / p99 ms (n)" for k in rpcs), "server peak RSS MiB", "errors"], rows)
            + f"\n\nMix: {mix}; {r['rows'][0]['seconds']:g} s a level; {r['workers']} client processes.\n\n"
            + sources(named))


def remote(named: Named) -> str:
    (_, r), = named
    fetch_rows = [[f"`{x['path'].split(':')[0]}`: {x['path'].split(':', 1)[1].strip()}" if ":" in x["path"]
                   else f"`{x['path']}`", num(x["seconds"], 3), x.get("GB_per_s", "-")] for x in r["fetch"]]
    nodes = list(r["sharing"][0]["node_share"])
    share_rows = [["on (write-through: a node plans with what the others stored)" if s["arm"] == "remote"
                   else "off (each node reuses only what it stored)", *(pct(s["node_share"][n]) for n in nodes),
                   pct(s["total_share"])] for s in r["sharing"]]
    return (table(["path", "seconds", "GB/s"], fetch_rows) + "\n\n"
            + table(["remote tier", *(f"node {n.upper()}" for n in nodes), "all"], share_rows)
            + f"\n\nHosts: {r['hosts']}; {r['chunks']} chunks x {r['tokens']} tokens ({r['model']}).\n\n{sources(named)}")


def front_order(named: Named) -> str:
    (_, r), = named
    rows = [["on" if x["follow_prefix"] else "off", f"{x['second_pass_same_order']}/{x['requests']} "
             f"({pct(x['second_pass_share'])})", f"{x['third_pass_same_order']}/{x['requests']} "
             f"({pct(x['third_pass_share'])})", f"{x['seen_set_same_order']}/{x['seen_set_requests']} "
             f"({pct(x['seen_set_share'])})"] for x in r["rows"]]
    return table(["CP-Tree path first", "2nd pass = 1st", "3rd pass = 2nd", "a chunk set seen before, 1st pass"],
                 rows) + f"\n\n{sources(named)}"


VIEWS = {"planner": planner, "plan-latency": plan_latency, "eviction": eviction, "hit-rate": hit_rate,
         "reuse-writes": reuse_writes, "crash": crash, "fetch": fetch, "load": load, "remote": remote,
         "front-order": front_order}
