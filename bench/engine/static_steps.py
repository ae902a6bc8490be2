"""The blend loop's static steps against its eager step, on real weights (docs/adapter.md,
"Static steps").

    python -m kvbench.engine.static_steps [--model quality|smollm2] [--chunk-len 40]

Every policy that blends (naive, Cache-Craft's top 15% of each chunk, CacheBlend 15%, the
default) over one prompt of 3 random-token chunks stored behind other chunks and an 8-token
question, three ways on the same weights (fp32): plain torch (the CPU path), the engine's Triton
path (eager), and that path on static steps (`graphs.StepGraphs`: padded buckets, one
CUDA graph a layer on CUDA).
Prints, per policy, how many layers ran static and the largest logit difference of the static
steps from the eager Triton step and from plain torch, beside the reuse probe's tolerance.

On the CPU (no CUDA) the Triton kernels run in Triton's interpreter, set here: slow (SmolLM2-135M:
about 1.5 minutes a static prefill, the padding is most of the rows), a check rather than a
benchmark. Models: `quality`, the trained quality model that ships with kvbench
(docs/quality.md); `smollm2`, SmolLM2-135M-Instruct as `kvcraft model fetch` leaves it
(docs/real-model.md).
"""

from __future__ import annotations

import argparse
import os
import time

if not os.environ.get("TRITON_INTERPRET"):  # before kvkernels is imported; no effect where CUDA runs Triton
    try:
        import torch as _torch

        if not _torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:  # pragma: no cover - torch is a dependency
        pass

import torch  # noqa: E402

from engine_adapter.blend import blend_prefill  # noqa: E402
from engine_adapter.graphs import StepGraphs  # noqa: E402
from engine_adapter.llama import LlamaEngine  # noqa: E402
from engine_adapter.policy import Policy  # noqa: E402
from engine_adapter.probe import TOLERANCE, TRUSTED  # noqa: E402
from engine_adapter.prompt import Segment  # noqa: E402
from engine_adapter.source import InMemoryLayerSource  # noqa: E402
from kvbench.common.args import count

POLICIES = (("naive", {}, 0.0), ("cachecraft", {}, 0.15), ("cacheblend", {"ratio": 0.15}, 0.0), ("query", {}, 0.0))


def _prompt(engine: LlamaEngine, chunk_len: int, chunks: int = 3, question: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(5, min(engine.cfg.vocab_size, 20000), (n,), generator=g).tolist()  # noqa: E731
    texts = [rand(chunk_len) for _ in range(chunks)]
    others = [rand(chunk_len) for _ in range(chunks)]
    stored = {i: blend_prefill(engine, [Segment(o), Segment(c)], Policy("full"), InMemoryLayerSource({}),
                               gate=TRUSTED).fresh[1] for i, (o, c) in enumerate(zip(others, texts))}
    question_tokens = rand(question)

    def segments(share: float) -> list[Segment]:  # share: each chunk's top tokens by stored inter-attention
        out = []
        for i, c in enumerate(texts):
            tia = torch.tensor(stored[i].stats.token_inter_attention, device="cpu")
            top = sorted(tia.topk(round(share * len(c))).indices.tolist()) if share else []
            out.append(Segment(c, cached=True, cached_prefix=stored[i].prefix, recompute=top))
        return out + [Segment(question_tokens, question=True)]

    return segments, {i: v.kv for i, v in stored.items()}


def run(path: str, chunk_len: int, device: str, **buckets: int) -> list[dict]:
    """`buckets`: `graphs.StepGraphs`' tokens_step and rows_step (default: a deployment's)."""
    torch_step = LlamaEngine.from_pretrained(path, dtype=torch.float32)
    if device != "cpu":
        torch_step = LlamaEngine(torch_step.cfg, {n: w.to(device) for n, w in torch_step.w.items()}, triton=False)
    triton_step = LlamaEngine(torch_step.cfg, torch_step.w, triton=True)
    static = StepGraphs(triton_step, **buckets)
    rows = []
    with torch.device(device):
        segments, kv = _prompt(torch_step, chunk_len)
        for name, options, share in POLICIES:
            out = {}
            for how, engine, steps in (("torch", torch_step, None), ("eager", triton_step, None),
                                       ("static", triton_step, static)):
                t0 = time.perf_counter()
                r = blend_prefill(engine, segments(share), Policy(name, **options), InMemoryLayerSource(kv),
                                  gate=TRUSTED, stats=False, steps=steps)
                out[how] = (r, time.perf_counter() - t0)
            got, eager = out["static"][0].logits.float(), out["eager"][0].logits.float()
            rows.append({"policy": name, "layers": torch_step.cfg.num_layers,
                         "static_layers": sum(t.static for t in out["static"][0].timings),
                         "vs_eager": float((got - eager).abs().max()),
                         "vs_torch": float((got - out["torch"][0].logits.float()).abs().max()),
                         "tolerance": TOLERANCE[torch.float32] * max(1.0, float(eager.abs().max())),
                         "same_top1": bool(got.argmax() == eager.argmax()),
                         "eager_s": out["eager"][1], "static_s": out["static"][1]})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("quality", "smollm2"), default="quality")
    ap.add_argument("--chunk-len", type=count(), default=40)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if args.model == "quality":
        from kvbench.quality import modeling

        path = str(modeling.MODEL_DIR)
    else:
        from kvbench.common.realmodel import fetch

        path = str(fetch().path)
    rows = run(path, args.chunk_len, args.device)
    print(f"{args.model} ({path}), {rows[0]['layers']} layers, 3 x {args.chunk_len} + 8 tokens, fp32, "
          f"{args.device}")
    print(f"{'policy':11s} {'static layers':>13s} {'max|static-eager|':>18s} {'max|static-torch|':>18s} "
          f"{'tolerance':>10s} {'top-1':>6s}")
    for r in rows:
        print(f"{r['policy']:11s} {r['static_layers']:>7d} of {r['layers']:<3d} {r['vs_eager']:>18.2e} "
              f"{r['vs_torch']:>18.2e} {r['tolerance']:>10.2e} {'same' if r['same_top1'] else 'DIFF':>6s}")


if __name__ == "__main__":
    main()
