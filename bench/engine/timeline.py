"""Per-layer timeline of blended prefills (wait vs compute), the figure in docs/adapter.md.

    python -m kvbench.engine.timeline docs/adapter-timeline.png

An in-process run on CPU: a random-weight Llama of a small shape, 4 chunks of 96
tokens cached behind other chunks, a 16-token question, and a LayerSource whose layer
l arrives (l+1) x interval after the prefill starts (a layer-wise fetch from a slower tier).
"""

from __future__ import annotations

import sys
import time

import torch

from engine_adapter.blend import BlendResult, blend_prefill
from engine_adapter.llama import LlamaConfig, LlamaEngine
from engine_adapter.policy import Policy
from engine_adapter.probe import TRUSTED
from engine_adapter.prompt import Segment
from engine_adapter.source import InMemoryLayerSource, ScheduledLayerSource

SHAPE = LlamaConfig("small", vocab_size=1024, hidden_size=256, intermediate_size=688, num_layers=8,
                    num_heads=8, num_kv_heads=2, head_dim=32)


def run(chunk_len: int = 96, interval_s: float = 0.03) -> list[tuple[str, BlendResult, float]]:
    torch.set_num_threads(1)  # comparable with run_service; no OpenMP stalls on a shared machine
    torch.manual_seed(0)
    eng = LlamaEngine.random(SHAPE, seed=0, std=0.05)
    rand = lambda n: torch.randint(0, SHAPE.vocab_size, (n,)).tolist()  # noqa: E731
    chunks, question = [rand(chunk_len) for _ in range(4)], rand(16)
    cache = {}
    for i, c in enumerate(chunks):
        r = blend_prefill(eng, [Segment(rand(chunk_len)), Segment(c)], Policy("full"),
                          InMemoryLayerSource({}), gate=TRUSTED)
        cache[i] = r.fresh[1]

    def segs(ratio: float) -> list[Segment]:
        out = []
        for i, c in enumerate(chunks):
            n = round(ratio * len(c))
            top = torch.tensor(cache[i].stats.token_inter_attention).topk(n).indices.tolist() if n else []
            out.append(Segment(c, cached=True, cached_prefix=cache[i].prefix, recompute=top))
        return out + [Segment(question, question=True)]

    cases = [
        ("full prefill", Policy("full"), 0.0, ()),
        ("naive reuse", Policy("naive"), 0.0, ()),
        ("cachecraft 15%", Policy("cachecraft"), 0.15, ()),
        ("cacheblend r=15%", Policy("cacheblend", ratio=0.15), 0.0, ()),
        ("cacheblend, chunk 1\nlayer 4 missing", Policy("cacheblend", ratio=0.15), 0.0, {(1, 4)}),
    ]
    blend_prefill(eng, segs(0.15), Policy("naive"), InMemoryLayerSource({}), gate=TRUSTED)  # warm-up
    ref = eng.prefill(torch.tensor(sum(chunks, []) + question), kv=False)[0][-1]
    out = []
    for name, policy, ratio, withhold in cases:
        src = ScheduledLayerSource({i: v.kv for i, v in cache.items()}, interval_s, withhold=withhold)
        r = blend_prefill(eng, segs(ratio), policy, src, gate=TRUSTED)
        out.append((name, r, float((r.logits - ref).norm() / ref.norm())))
    return out


def run_service(chunk_len: int = 96) -> list[tuple[str, BlendResult, float]]:
    """The same prompt served through a real kvcraft service on loopback, with the host
    tier off (1-byte budget), so every layer is read from disk files, checksummed and
    streamed over gRPC while the adapter computes."""
    import tempfile
    from pathlib import Path

    from engine_adapter.rag import RAGAdapter
    from kvclient.client import KVClient
    from kvservice.launcher import ServiceProcess

    torch.set_num_threads(1)  # the service shares this small machine: no OpenMP stalls
    torch.manual_seed(0)
    eng = LlamaEngine.random(SHAPE, seed=0, std=0.05)
    rand = lambda n: torch.randint(0, SHAPE.vocab_size, (n,)).tolist()  # noqa: E731
    chunks, question = [rand(chunk_len) for _ in range(4)], rand(16)
    cases = [
        ("full prefill", Policy("full")),
        ("naive reuse", Policy("naive")),
        ("cachecraft (planned CFO)", Policy("cachecraft")),
        ("cacheblend r=15%", Policy("cacheblend", ratio=0.15)),
    ]
    out = []
    with tempfile.TemporaryDirectory(prefix="kvcraft-timeline-") as tmp:
        with ServiceProcess(Path(tmp) / "data", host_budget_bytes=1) as service, KVClient(service.address) as c:
            # chunk caches from another context: each chunk stored behind a random chunk
            warm = RAGAdapter(eng, c, Policy("full"), gate=TRUSTED)
            for ch in chunks:
                warm.prefill([rand(chunk_len), ch], question, reorder=False)
            warm.close()
            ref = eng.prefill(torch.tensor(sum(chunks, []) + question), kv=False)[0][-1]
            RAGAdapter(eng, c, Policy("naive"), gate=TRUSTED, store_back=False).prefill(chunks, question,
                                                                                       reorder=False)  # warm-up
            for name, policy in cases:
                # no shadow prefills (engine_adapter.fidelity) beside the timelines recorded
                adapter = RAGAdapter(eng, c, policy, gate=TRUSTED, store_back=False, shadows=False)
                r, _ = adapter.prefill(chunks, question, reorder=False)
                out.append((name, r, float((r.logits - ref).norm() / ref.norm())))
    return out


def plot(results: list[tuple[str, BlendResult, float]], path: str,
         source: str = "stored layer l arrives 30 ms x (l+1) after the start") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 0.9 * len(results) + 1.2))
    for y, (name, r, dev) in enumerate(results):
        t = 0.0
        for layer, tm in enumerate(r.timings):
            ax.barh(y, tm.wait_s * 1e3, left=t, color="0.8", edgecolor="white")
            t += tm.wait_s * 1e3
            color = "tab:red" if any(l == layer for _, l in r.fallbacks) else f"C{layer % 2}"
            ax.barh(y, tm.compute_s * 1e3, left=t, color=color, edgecolor="white")
            t += tm.compute_s * 1e3
        ax.text(t + 1, y, f"{t:.0f} ms, recompute {r.recompute_ratio:.0%}, dev {dev:.3f}",
                va="center", fontsize=8)
    ax.set_yticks(range(len(results)), [n for n, _, _ in results], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms since prefill start (grey: waiting for layer l; blue/orange: compute of layer l; "
                  "red: layer with catch-up)", fontsize=8)
    ax.set_title(f"Blended prefill per layer, CPU, {SHAPE.num_layers}-layer random Llama "
                 f"(hidden {SHAPE.hidden_size}), 4x96-token chunks + 16-token question\n{source}", fontsize=9)
    ax.set_xlim(right=ax.get_xlim()[1] * 1.35)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> None:
    """python -m kvbench.engine.timeline [--service] [PATH]"""
    service = "--service" in argv
    argv = [a for a in argv if a != "--service"]
    path = argv[0] if argv else ("docs/adapter-timeline-service.png" if service else "docs/adapter-timeline.png")
    t0 = time.perf_counter()
    if service:
        results = run_service()
        plot(results, path, "real kvcraft service on loopback, disk tier, layers streamed over gRPC (Lp from the plan)")
    else:
        results = run()
        plot(results, path)
    for name, r, dev in results:
        print(f"{name.replace(chr(10), ' ')}: total {sum(t.wait_s + t.compute_s for t in r.timings) * 1e3:.1f} ms, "
              f"wait {sum(t.wait_s for t in r.timings) * 1e3:.1f} ms, recompute {r.recompute_ratio:.2f}, "
              f"rel. logit dev {dev:.4f}, fallbacks {r.fallbacks}")
    print(f"wrote {path} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
