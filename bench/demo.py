"""`kvcraft demo`: start a service on a free loopback port and show what reuse buys, in about a minute.

1. Speed, where prefill compute dominates: an 8-layer random-weight Llama (hidden 768,
   12 heads / 4 KV heads) and a RAG prompt of 4 retrieved chunks x 256 tokens + a
   32-token question. Earlier requests left each chunk's KV in the service, computed
   behind OTHER chunks. The same prompt is then served by full prefill and through the
   adapter (Plan, KV from the service's shared memory, blended prefill, Release) with
   naive reuse, CacheBlend at a 15% budget and Cache-Craft as the planner sizes it.
2. Answers: the small Llama trained here on a multi-hop task (`bench/quality/model`,
   docs/quality.md) answers held-out questions whose chunks were stored behind chunks
   of another prompt. Two more requests per prompt compute its chunks again behind
   yet other chunks; their store-backs teach the service which tokens of each chunk
   matter (learned recompute lists, the default). The same questions by full prefill,
   naive reuse, CacheBlend (r = 30%) and kvcraft's default (Cache-Craft with the learned
   lists, budget as the planner sizes it): answers shown, accuracy counted.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

SPEED_LAYERS = 8
SPEED_CHUNKS, SPEED_CHUNK_LEN, SPEED_QUESTION_LEN = 4, 256, 32
QUALITY_EXAMPLES = 24


def run_demo(data_dir: str | None = None, *, quality_examples: int = QUALITY_EXAMPLES) -> int:
    import torch
    from rich.console import Console

    from kvclient.client import KVClient
    from kvservice.launcher import ServiceProcess

    console = Console(width=130)
    # The service runs in a second process on the same (small) machine: with torch's
    # default thread pool, every op's OpenMP region stalls whenever the service
    # takes a core, and timings turn to noise.
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    # no_grad as a context, not set_grad_enabled(False): tests call run_demo in-process,
    # and a process-wide switch broke a later test's backward pass.
    with torch.no_grad(), tempfile.TemporaryDirectory(prefix="kvcraft-demo-") as tmp:
        root = Path(data_dir) if data_dir else Path(tmp) / "data"
        with ServiceProcess(root) as service:
            console.print(f"kvcraft service on {service.address}, data in {root}")
            with KVClient(service.address) as client:
                won = _speed(console, client)
                kept = _answers(console, client, quality_examples)
                stats = client.stats()
                console.print(f"service holds {stats.chunks} chunks, {stats.variants} variants; "
                              + ", ".join(f"{t.name}: {t.bytes_used:,} B" for t in stats.tiers))
            code = service.stop()
        console.print(f"service stopped cleanly (exit {code}); demo took {time.perf_counter() - t_start:.0f} s")
    if not (won and kept):
        console.print("[red]reuse did not beat full prefill, or lost answers: see above[/red]")
    return 0 if code == 0 and won and kept else 1


def _speed(console, client) -> bool:  # noqa: ANN001 - rich Console, KVClient
    """Reuse beside full prefill on a shape where prefill compute dominates."""
    import torch
    from rich.table import Table

    from engine_adapter import CacheBlend, CacheCraft, LlamaConfig, LlamaEngine, Naive, Policy, ReuseGate
    from engine_adapter.service import RAGAdapter

    cfg = LlamaConfig("demo-8l-768", vocab_size=32000, hidden_size=768, intermediate_size=2048,
                      num_layers=SPEED_LAYERS, num_heads=12, num_kv_heads=4, head_dim=64)
    engine = LlamaEngine.random(cfg, seed=0, std=0.05)
    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    chunks = [rand(SPEED_CHUNK_LEN) for _ in range(SPEED_CHUNKS)]
    question = rand(SPEED_QUESTION_LEN)
    n = SPEED_CHUNKS * SPEED_CHUNK_LEN + SPEED_QUESTION_LEN
    console.print(f"\n[bold]1. Speed[/bold]: {cfg.num_layers}-layer random-weight Llama (hidden {cfg.hidden_size}, "
                  f"{cfg.num_heads}/{cfg.num_kv_heads} heads, fp32), {SPEED_CHUNKS} chunks x {SPEED_CHUNK_LEN} tokens "
                  f"+ {SPEED_QUESTION_LEN}-token question = {n} tokens, one CPU thread")
    gate = ReuseGate()
    t0 = time.perf_counter()
    warm = RAGAdapter(engine, client, Policy("full"), gate=gate)
    for c in chunks:  # earlier requests: each chunk served behind another chunk, stored back
        warm.prefill([rand(SPEED_CHUNK_LEN), c], question, reorder=False)
    warm.close()
    console.print(f"earlier requests stored each chunk's KV (K without RoPE) computed behind another chunk "
                  f"({time.perf_counter() - t0:.1f} s)")

    tokens = torch.tensor(sum(chunks, []) + question)
    logits: list = []

    def full() -> tuple[float, object, object]:
        t = time.perf_counter()
        logits[:] = [engine.prefill(tokens, all_logits=False)[0][-1]]
        return time.perf_counter() - t, None, None

    def reuse(policy):  # noqa: ANN001, ANN202
        def go() -> tuple[float, object, object]:
            adapter = RAGAdapter(engine, client, policy, gate=gate, store_back=False, local=True)
            r, rep = adapter.prefill(chunks, question, reorder=False)
            adapter.close()
            return rep.ttft_s, r, rep
        return go

    cases = [("full prefill", full), ("naive reuse", reuse(Naive())),
             ("cacheblend, 15% budget", reuse(CacheBlend(budget=0.15))),
             ("cachecraft, planned", reuse(CacheCraft()))]
    for _, run in cases:
        run()  # warm-up (allocator, first Locate, the reuse probe)
    ref = logits[0]  # full prefill's first-token logits, the reference for the deviation
    times: dict[str, list[float]] = {name: [] for name, _ in cases}
    last: dict[str, tuple] = {}
    for _ in range(2):
        for name, run in cases:
            ttft, r, rep = run()
            times[name].append(ttft)
            last[name] = (r, rep)
    full_s = statistics.median(times["full prefill"])
    table = Table(title="the same RAG prompt, chunk KVs from the service's shared memory (median of 2)")
    for col in ("serving", "reused chunks", "row-layers computed", "fetch wait ms", "TTFT ms", "speed-up",
                "first-token logit dev"):
        table.add_column(col, justify="right")
    won = True
    for name, _ in cases:
        s = statistics.median(times[name])
        r, rep = last[name]
        if r is None:
            table.add_row(name, "0", "100%", "-", f"{s * 1e3:.0f}", "1.0x", "0")
            continue
        dev = float((r.logits - ref).norm() / ref.norm())
        table.add_row(name, f"{rep.reused_chunks}/{SPEED_CHUNKS}", f"{r.computed_share:.0%}",
                      f"{rep.fetch_wait_s * 1e3:.1f}", f"{s * 1e3:.0f}", f"{full_s / s:.1f}x", f"{dev:.3f}")
        won &= name != "naive reuse" or s < full_s
    console.print(table)
    console.print("Row-layers computed: the prompt's rows x layers that ran (layer 0 and the question "
                  "included). Random weights: the logit deviation shows how far reuse drifts, not "
                  "answer quality; that is part 2. Full benchmark: python -m kvbench.ttft "
                  "(docs/benchmarks.md).")
    return won


def _answers(console, client, n: int) -> bool:  # noqa: ANN001 - rich Console, KVClient
    """The trained model answers the same questions with and without reuse."""
    import torch
    from rich.table import Table

    from engine_adapter import CacheBlend, LlamaEngine, Naive, Policy, ReuseGate
    from engine_adapter.service import RAGAdapter
    from kvbench.quality import modeling, selection

    console.print(f"\n[bold]2. Answers[/bold]: the model trained on the multi-hop task (bench/quality/model), "
                  f"{n} held-out questions; each chunk's KV stored behind a chunk of another prompt")
    engine = LlamaEngine.from_pretrained(modeling.MODEL_DIR)
    model_id = engine.model_spec().fingerprint()
    tok = modeling.build_tokenizer()
    prompts = selection.prompts(engine, n)
    for p in prompts:
        for j, c in enumerate(p.chunks):
            v = p.stored[j]
            client.store(model_id, c, v.kv, prefix_keys=list(v.prefix), stats=v.stats)
    gate = ReuseGate()
    _learning_requests(engine, client, prompts, gate)
    settings = [("naive reuse", Naive()), ("cacheblend r=30%", CacheBlend(ratio=0.30)),
                (DEFAULT_COLUMN, Policy("cachecraft"))]
    adapters = {name: RAGAdapter(engine, client, pol, gate=gate, store_back=False, local=True)
                for name, pol in settings}
    word = lambda t: tok.decode([t]).strip()  # noqa: E731
    hits = {"full prefill": 0, **{name: 0 for name, _ in settings}}
    computed = {name: [] for name, _ in settings}
    table = Table(title=f"first {min(n, 8)} of {n} questions (answers in bold are right)")
    for col in ("question", "answer", "full prefill", *(name for name, _ in settings)):
        table.add_column(col)
    for i, p in enumerate(prompts):
        full = int(engine.prefill(torch.tensor(sum(p.chunks, []) + p.question), all_logits=False)[0][-1].argmax())
        got = {"full prefill": full}
        for name, _ in settings:
            r, _ = adapters[name].prefill(p.chunks, p.question, reorder=False)
            got[name] = int(r.logits.argmax())
            computed[name].append(r.computed_share)
        for name, t in got.items():
            hits[name] += t == p.answer
        if i < 8:
            show = lambda t: f"[bold]{word(t)}[/bold]" if t == p.answer else word(t)  # noqa: E731
            table.add_row(tok.decode(p.question), word(p.answer), *(show(got[k]) for k in hits))
    for a in adapters.values():
        a.close()
    table.add_row("[bold]accuracy[/bold]", "", *(f"{hits[k]}/{n} = {hits[k] / n:.0%}" for k in hits))
    table.add_row("row-layers computed", "", "100%",
                  *(f"{statistics.mean(computed[k]):.0%}" for k, _ in settings))
    console.print(table)
    console.print("Naive reuse keeps each chunk's KV as it was computed, behind a stranger, so a "
                  "'they' chunk stays bound to the wrong person and cross-chunk questions are lost. "
                  "CacheBlend recomputes the tokens whose KV deviates most and gets them back; the "
                  "default recomputes the tokens the learned lists name, within the planner's budget. "
                  "(This 4-layer model is tiny: its prefill takes milliseconds, so part 1 is where "
                  "the time goes; docs/quality.md has 200-300-question runs of every policy.)")
    return all(hits[k] >= hits["full prefill"] - max(1, n // 10) for k in ("cacheblend r=30%", DEFAULT_COLUMN))


DEFAULT_COLUMN = "default (learned)"


def _learning_requests(engine, client, prompts, gate) -> None:  # noqa: ANN001
    """Two later requests per prompt, served by full prefill: each shuffles the prompt's
    chunks together with two chunks of another prompt (a different one each time) and asks
    the prompt's question, as kvbench.quality.evaluate's learning passes do. Their store-backs find the variant stored earlier and send, with the new
    variant, which tokens' recompute repairs that answer most (`RAGAdapter(learn=True)`,
    the default: `selection.learn`); the planner spends its budget on those tokens."""
    import random

    from engine_adapter import Policy
    from engine_adapter.service import RAGAdapter

    rng = random.Random(7)
    warm = RAGAdapter(engine, client, Policy("full"), gate=gate, local=True)
    for k in (1, 2):
        for i, p in enumerate(prompts):
            other = prompts[(i + k) % len(prompts)]
            mixed = [list(c) for c in p.chunks] + [list(c) for c in other.chunks[:2]]
            rng.shuffle(mixed)
            warm.prefill(mixed, list(p.question), reorder=False)
    warm.close()


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvbench.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", help="default: a temporary directory")
    ap.add_argument("--questions", type=int, default=QUALITY_EXAMPLES)
    a = ap.parse_args(argv)
    return run_demo(a.data_dir, quality_examples=a.questions)


if __name__ == "__main__":
    raise SystemExit(main())
