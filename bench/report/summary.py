"""The at-a-glance table of docs/benchmarks.md: per results file, its benchmark's goal and what the
file says about it (a headline per benchmark name), so the summary cannot drift from the tables."""

from __future__ import annotations

from typing import Callable

from kvbench.report.markdown import num, pct, table

Named = list[tuple[str, dict]]
Row = tuple[str, str, str]  # benchmark, goal, now


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def planner(r: dict) -> list[Row]:
    out = []
    for trace, t in r["traces"].items():
        s = t["computed_share"]
        if trace == "default":
            fewer = 1 - s["craft"] / s["prefix-caching"]
            out.append(("planner, default trace", "CRAFT computes >= 19% fewer chunk tokens than prefix caching",
                        f"{pct(fewer)} fewer: {_met(fewer >= 0.19)}"))
        else:
            out.append((f"planner, {trace} trace", "CRAFT + Cache-Craft computes <= 25% of full prefill's chunk tokens",
                        f"{pct(s['craft+cache-craft'])}: {_met(s['craft+cache-craft'] <= 0.25)}"))
    return out


def plan_latency(r: dict) -> list[Row]:
    x = r["rows"][-1]
    ok = x["in_process_p99_us"] < 100 and x["blocking_p99_us"] < 1000 and x["server_peak_rss_gb"] < 2
    return [(f"plan latency, {x['variants']:,} variants", "planner p99 < 100 µs; Plan over gRPC p99 < 1 ms; server RSS < 2 GB",
             f"{num(x['in_process_p99_us'])} µs, {num(x['blocking_p99_us'] / 1e3, 2)} ms (`KVClient`), "
             f"{x['server_peak_rss_gb']:.2f} GB: {_met(ok)}")]


def fetch(r: dict) -> list[Row]:
    rows = {x["path"]: x for x in next(iter(r["servers"].values()))}
    g, s = rows["grpc-stream"], rows["store-client"]
    return [("fetch", "gRPC fetch >= 0.9x of a raw grpcio stream",
             f"{g['vs_limit']:.2f}x ({g['vs_limit_range'][0]:.2f}-{g['vs_limit_range'][1]:.2f}): {_met(g['vs_limit'] >= 0.9)}"),
            ("store", "co-located Store >= 0.8x of write + fsync",
             f"{s['vs_limit']:.2f}x: {_met(s['vs_limit'] >= 0.8)}")]


def load(r: dict) -> list[Row]:
    out = []
    for x in r["rows"]:
        worst = max(x["rpc"]["fetch"]["p99_ms"], x["rpc"]["store"]["p99_ms"])
        out.append((f"load, {x['clients']} clients", "fetch and store p99 < 500 ms",
                    f"{num(worst, 0)} ms at most: {_met(worst < 500)}"))
    return out


def ttft(r: dict) -> list[Row]:
    rows = {c["case"]: c for c in r["runs"][0]["rows"]}
    best = max((c for c in rows.values() if c["group"] != "full" and c["computed_share"] <= 0.15
                and not c["case"].startswith("naive")), key=lambda c: c["speedup_vs_transformers"], default=None)
    naive = rows.get("naive (shm)")
    if best is None or naive is None:
        return []
    ok = best["speedup_vs_transformers"] >= 4 and naive["speedup_vs_transformers"] >= 10
    return [("TTFT, " + r["runs"][0]["shape"]["model"], "a policy at <= 15% computed >= 4x faster than transformers' "
             "SDPA prefill; naive >= 10x", f"{best['case']} {best['speedup_vs_transformers']:.1f}x at "
             f"{pct(best['computed_share'])}, naive {naive['speedup_vs_transformers']:.1f}x: {_met(ok)}")]


def hit_rate(r: dict) -> list[Row]:
    out = []
    for t in r["traces"]:
        small = min(x["capacity_share"] for x in t["rows"])
        at = {x["order"]: x["hit_rate"] for x in t["rows"] if x["capacity_share"] == small}
        out.append((f"hit rate, {t['preset']} trace, cache of {pct(small, 0)}", "(no goal)",
                    ", ".join(f"{o} {pct(h)}" for o, h in at.items())))
    return out


def vllm_ttft(r: dict) -> list[Row]:
    head = next(x for x in r["rows"] if "cacheblend" in x["mode"])
    return [("vLLM TTFT", "CacheBlend 15% >= 4x lower TTFT than vLLM alone at p50",
             f"{head['speedup_p50']:.2f}x: {_met(head['speedup_p50'] >= 4)}")]


def vllm_concurrency(r: dict) -> list[Row]:
    top = max(x["concurrent"] for x in r["rows"])
    rows = [x for x in r["rows"] if x["concurrent"] == top]
    alone = next(x for x in rows if x["mode"] == "vLLM alone")
    best = max((x for x in rows if "blend_s_sum" in x), key=lambda x: x["requests_per_s"])
    times = best["requests_per_s"] / alone["requests_per_s"]
    return [(f"vLLM, {top} requests at once", "vLLM + kvcraft serves >= 3x the requests per second of vLLM alone",
             f"{times:.2f}x ({best['mode']}, {best['requests_per_s']:.2f} req/s): {_met(times >= 3)}")]


def vllm_quality(r: dict) -> list[Row]:
    rows = [x for x in r["rows"] if x.get("reference")]
    within = sum(abs(x["vllm"]["accuracy"] - x["reference"]["accuracy"]) <= 0.02 for x in rows)
    return [("vLLM quality", "every policy within 2 points of kvcraft's reference engine",
             f"{within} of {len(rows)}: {_met(within == len(rows))}")]


def vllm_rag(r: dict) -> list[Row]:
    fewer = [(k, v) for k, v in r.items() if k.endswith("_fewer_chunk_tokens_vs_vllm")]
    return [("vLLM, RAG trace", ">= 19% fewer chunk tokens computed than vLLM alone",
             ", ".join(f"{pct(v)} ({k.split('_fewer')[0].replace('_', ' ')})" for k, v in fewer)
             + f": {_met(all(v >= 0.19 for _, v in fewer))}")]


def deployed(r: dict) -> list[Row]:
    q = next((x for x in r["rows"] if x["policy"] == "query"), None)
    if q is None:
        return []
    ok = q["of_full"] >= 0.98 and q["computed_share_as_retrieved"] <= 0.15
    return [(f"answer quality as deployed, {r['task']} task", ">= 98% of full prefill's accuracy at <= 15% recompute",
             f"{pct(q['of_full'])} at {pct(q['computed_share_as_retrieved'])}: {_met(ok)}")]


def real_quality(r: dict) -> list[Row]:
    q = next((p for p in r["policies"] if p["policy"] == "query:deviation=0.5"), None)
    if q is None:
        return []
    return [("real model on MuSiQue, default policy", "ROUGE-L vs full >= 0.90; first token = full >= 95%",
             f"{q['rouge_l_vs_full']:.3f}, {pct(q['first_token_agrees'], 0)} at {pct(q['computed_share'])}: "
             f"first token {_met(q['first_token_agrees'] >= 0.95)}, ROUGE-L {_met(q['rouge_l_vs_full'] >= 0.9)}")]


HEADLINES: dict[str, Callable[[dict], list[Row]]] = {
    "planner": planner, "plan-latency": plan_latency, "fetch": fetch, "load": load, "ttft": ttft,
    "hit-rate": hit_rate, "vllm-ttft": vllm_ttft, "vllm-concurrency": vllm_concurrency,
    "vllm-quality": vllm_quality, "vllm-rag": vllm_rag, "deployed": deployed, "real-quality": real_quality}


def summary(named: Named) -> str:
    rows = [[b, goal, f"{now} ([{name}](results/{name}))"] for name, r in named for b, goal, now in
            HEADLINES[r["name"]](r)]
    return table(["benchmark", "goal", "now (its results)"], rows)


VIEWS = {"summary": summary}
