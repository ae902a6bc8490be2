"""Time to first token of reuse against full prefill, side by side in one run, on CPU.

    kvcraft bench ttft --repeats 3
    kvcraft bench ttft --chunks 2 4 8 --chunk-len 128   # one run per prompt length
    kvcraft bench ttft --real                          # the real model on a MuSiQue prompt

A compute-dominant shape: a random-weight Llama (12 layers, hidden 768, 12 heads / 4 KV
heads, MLP 2048, vocab 32000, fp32), 5 retrieved chunks of 256 tokens + a 32-token
question. Every chunk's KV was stored in a real kvcraft service (its own process, on
loopback) behind ANOTHER chunk first, as an earlier request would have left it. Then the
same prompt is served:

- full prefill: transformers' `LlamaForCausalLM` (SDPA attention, `logits_to_keep=1`) with
  the same weights, as an outside reference, and the engine's own `LlamaEngine.prefill`;
- through `RAGAdapter` (Plan, fetch, blended prefill, Release; nothing stored back) with
  naive reuse, the default policy (`query` at its 15% budget: the question first, then the
  tokens it reads), CacheBlend at several budgets, Cache-Craft recomputing the top share of
  each chunk by eq. 14 at several shares, Cache-Craft as the planner sizes it (the
  service's default alpha), and the prefix cache (exact variants of the first 3 chunks,
  stored last); stored KV read from the service's shared memory ("shm") or streamed
  over gRPC ("grpc").

Each case runs `--repeats` times, cases interleaved, and the median is kept. With several
`--chunks`, one run per count (each on its own service), in one results file: the prompt
lengths of the TTFT-against-length plot (`kvcraft bench report`). The split:
fetch wait, merge + re-rotation, recompute (Q/K/V, MLP, HKVD, statistics), attention,
logits, other (Plan, Locate, Release, setup). "ideal" is 1 / the share of the prompt's
row-layers computed (layer 0 and the question included): the speed-up if everything but
that compute were free. One torch thread by default: the service shares this small
machine, and a second OpenMP thread stalls whenever it is busy.

`--real [DIR]`: the real model instead (SmolLM2-135M-Instruct, `kvbench.common.realmodel`: the
folder `kvcraft model fetch` builds, fetched if absent; 30 layers, hidden 576, 9 / 3 KV
heads) on a MuSiQue record of the sample (`kvbench.common.musique`: chat template, instruction
segment, one chunk per passage, question). `--passages` above the record's 3 adds
passages of the following records as further retrieved passages. The instruction chunk
is stored as a request with it alone left it; each passage behind the instruction and
a passage of another record.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from engine_adapter import CacheBlend, CacheCraft, LlamaConfig, LlamaEngine, Naive, Policy, ReusePolicy
from engine_adapter.blend import BlendResult, blend_prefill
from engine_adapter.probe import TRUSTED
from engine_adapter.prompt import Layout, Segment
from engine_adapter.rag import RAGAdapter
from engine_adapter.source import InMemoryLayerSource
from kvbench import results
from kvbench.common.args import count
from kvclient.client import KVClient
from kvcraft.keys import chunk_key

SHAPE = LlamaConfig("ttft-bench", vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12,
                    num_heads=12, num_kv_heads=4, head_dim=64)


@dataclass(frozen=True)
class TopShare(CacheCraft):
    """Cache-Craft with the recompute set fixed to the top `share` of each chunk's tokens by
    stored inter-attention (eq. 14), instead of the plan's CFO-sized list: to sweep shares."""

    share: float = 0.1
    ranking: dict = field(default_factory=dict, compare=False)  # chunk key -> token indices, best first

    def first_rows(self, layout: Layout, s: int) -> Sequence[int]:
        order = self.ranking[layout.keys[s]]
        return sorted(order[:math.ceil(self.share * len(order))])


@dataclass
class Case:
    name: str
    run: Callable[[], tuple[float, BlendResult | None, object]]  # -> (ttft s, result, report)
    group: str = "reuse"
    samples: list[dict] = field(default_factory=list)


def _split(ttft: float, r: BlendResult | None, fetch_wait: float) -> dict:
    if r is None or not r.timings:
        return {"fetch_wait": 0.0, "rotate": 0.0, "recompute": 0.0, "attention": 0.0, "logits": 0.0,
                "other": 0.0, "compute": ttft}
    rotate = sum(t.rotate_s for t in r.timings)
    attend = sum(t.attend_s for t in r.timings)
    compute = sum(t.compute_s for t in r.timings)
    layers = sum(t.wait_s + t.compute_s for t in r.timings)
    return {"fetch_wait": fetch_wait, "rotate": rotate, "attention": attend,
            "recompute": compute - rotate - attend, "logits": r.logits_s,
            "other": max(0.0, ttft - layers - r.logits_s), "compute": 0.0}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    ap = argparse.ArgumentParser(prog="kvcraft bench ttft", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=count(), default=SHAPE.num_layers)
    ap.add_argument("--chunks", type=count(), nargs="+", default=[5], help="chunks per prompt (several: one run each)")
    ap.add_argument("--chunk-len", type=count(), default=256)
    ap.add_argument("--question-len", type=count(), default=32)
    ap.add_argument("--real", nargs="?", const="", metavar="DIR",
                    help="the real model (its folder; default: where `kvcraft model fetch` puts it) "
                         "on a MuSiQue prompt, instead of the random-weight shape")
    ap.add_argument("--record", type=count(0), default=0, help="with --real: the MuSiQue sample record")
    ap.add_argument("--passages", type=count(), default=3, help="with --real: retrieved passages in the prompt")
    ap.add_argument("--repeats", type=count(), default=3)
    ap.add_argument("--threads", type=count(), default=1)
    results.add_argument(ap, "ttft")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    runs = []
    with tempfile.TemporaryDirectory(prefix="kvcraft-ttft-") as tmp:
        for i, n in enumerate([None] if a.real is not None else a.chunks):
            if a.real is not None:
                work = real_workload(a.real or None, a.record, a.passages)
            else:
                work = random_workload(Path(tmp) / f"model{i}", a.layers, n, a.chunk_len, a.question_len)
            runs.append(run(work, a.repeats, Path(tmp) / f"data{i}"))
            print_table(runs[-1], a.repeats, a.threads)
    results.save("ttft", argv, {"repeats": a.repeats, "threads": a.threads, "runs": runs}, a.json)
    return 0


@dataclass
class Workload:
    """One prompt on one model, and how its chunks were stored before it is served."""

    engine: LlamaEngine
    hf: object  # transformers' LlamaForCausalLM (SDPA) with the same weights
    chunks: list[list[int]]
    question: list[int]
    behind: list[list[list[int]]]  # per chunk: the chunks it was computed behind when stored
    title: str  # the model and prompt, for the table
    shape: dict


def random_workload(folder: Path, layers: int, n_chunks: int, chunk_len: int, question_len: int) -> Workload:
    """The random-weight shape: every chunk stored behind one other random chunk."""
    from transformers import LlamaForCausalLM

    cfg = dataclasses.replace(SHAPE, num_layers=layers)
    engine = LlamaEngine.random(cfg, seed=0, std=0.05)
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    chunks = [rand(chunk_len) for _ in range(n_chunks)]
    others = [rand(chunk_len) for _ in range(n_chunks)]
    question = rand(question_len)
    engine.save_pretrained(folder)
    hf = LlamaForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    shape = {"model": "random Llama", "layers": layers, "hidden": cfg.hidden_size, "heads": cfg.num_heads,
             "kv_heads": cfg.num_kv_heads, "mlp": cfg.intermediate_size, "vocab": cfg.vocab_size,
             "chunks": n_chunks, "chunk_len": chunk_len, "question_len": question_len,
             "prompt_tokens": n_chunks * chunk_len + question_len, "dtype": "float32"}
    title = (f"{layers}-layer random Llama (hidden {cfg.hidden_size}), {n_chunks} x {chunk_len}-token chunks "
             f"+ {question_len}-token question, fp32")
    return Workload(engine, hf, chunks, question, [[o] for o in others], title, shape)


def real_workload(folder: str | None, record: int, passages: int) -> Workload:
    """The real model on MuSiQue sample record `record` with `passages` passages (beyond the
    record's own: the next records' passages). The instruction chunk is stored alone; each
    passage behind the instruction and a passage of another record."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvbench.common import musique, realmodel

    path = realmodel.fetch(folder).path
    tok = AutoTokenizer.from_pretrained(path)
    records = musique.load(passages=3)
    rec = records[record % len(records)]
    pool = [p for r in records[record + 1:] + records[:record] for p in r.passages]
    rec = dataclasses.replace(rec, passages=(rec.passages + tuple(pool))[:passages])
    p = musique.prompt(tok, rec)
    strangers = [musique.prompt(tok, dataclasses.replace(rec, passages=(pool[-1 - i],))).passages[0]
                 for i in range(len(p.passages))]
    engine = LlamaEngine.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32).eval()
    chunks = [list(c) for c in p.chunks()]
    behind = [[]] + [[list(p.instruction), list(o)] for o in strangers]
    c = engine.cfg
    n = len(p.tokens)
    shape = {"model": realmodel.NAME, "layers": c.num_layers, "hidden": c.hidden_size, "heads": c.num_heads,
             "kv_heads": c.num_kv_heads, "mlp": c.intermediate_size, "vocab": c.vocab_size,
             "chunks": len(chunks), "chunk_lens": [len(x) for x in chunks], "question_len": len(p.question),
             "prompt_tokens": n, "musique_record": rec.id, "passages": passages, "dtype": "float32"}
    title = (f"{realmodel.NAME} ({c.num_layers} layers, hidden {c.hidden_size}), MuSiQue record {rec.id}: "
             f"instruction + {passages} passages + question = {n} tokens, fp32")
    return Workload(engine, hf, chunks, list(p.question), behind, title, shape)


def store_chunks(engine: LlamaEngine, client: KVClient, model_id: str, work: Workload) -> dict:
    """Each chunk computed behind other chunks and stored; its tokens ranked by inter-attention
    (what `TopShare` recomputes first), by chunk key."""
    ranking = {}
    for c, before in zip(work.chunks, work.behind):
        segs = [Segment(b) for b in before] + [Segment(c)]
        fresh = blend_prefill(engine, segs, Policy("full"), InMemoryLayerSource({}),
                              gate=TRUSTED).fresh[len(before)]
        client.store(model_id, c, fresh.kv, prefix_keys=list(fresh.prefix), stats=fresh.stats)
        tia = torch.tensor(fresh.stats.token_inter_attention)
        ranking[chunk_key(model_id, c)] = tia.argsort(descending=True).tolist()
    return ranking


def via_adapter(work: Workload, client: KVClient, policy: ReusePolicy | None, local: bool) -> Callable:
    """A case's run: the prompt prefilled through the RAG adapter under `policy` (None: the
    adaptive adapter, at its Plans' budget)."""
    def go() -> tuple[float, BlendResult, object]:
        # no shadow prefills: one would run beside the next timed case
        adapter = RAGAdapter(work.engine, client, policy, gate=TRUSTED, store_back=False, local=local,
                             shadows=False)
        try:
            r, rep = adapter.prefill(work.chunks, work.question, reorder=False)
        finally:
            adapter.close()
        return rep.ttft_s, r, rep
    return go


def timed(f: Callable) -> Callable:
    """A case's run: `f` timed, no blend result."""
    def go() -> tuple[float, None, None]:
        t0 = time.perf_counter()
        with torch.no_grad():
            f()
        return time.perf_counter() - t0, None, None
    return go


def _cases(work: Workload, client: KVClient, tokens: torch.Tensor, ranking: dict) -> list[Case]:
    """Full prefill (transformers, the engine) and every reuse policy, over shm and gRPC."""
    engine, hf, layers = work.engine, work.hf, work.engine.cfg.num_layers

    def via(policy: ReusePolicy, local: bool) -> Callable:
        return via_adapter(work, client, policy, local)

    cases = [
        Case("transformers SDPA full prefill", timed(lambda: hf(tokens[None], logits_to_keep=1)), "full"),
        Case("engine full prefill", timed(lambda: engine.prefill(tokens, all_logits=False)), "full"),
        Case("naive (shm)", via(Naive(), True)),
        Case("naive (gRPC)", via(Naive(), False)),
    ]
    for share in (0.05, 0.10, 0.15):
        cases.append(Case(f"cachecraft top {share:.0%} (shm)", via(TopShare(share=share, ranking=ranking), True)))
    cases.append(Case("cachecraft top 10% (gRPC)", via(TopShare(share=0.10, ranking=ranking), False)))
    cases.append(Case("cachecraft planned (service alpha) (shm)", via(CacheCraft(), True)))
    for budget in (0.12, 0.15, 0.20):
        if budget * layers >= 1:
            cases.append(Case(f"cacheblend budget {budget:.0%} (shm)", via(CacheBlend(budget=budget), True)))
    if 0.15 * layers >= 1:
        cases.append(Case("cacheblend budget 15% (gRPC)", via(CacheBlend(budget=0.15), False)))
    cases.append(Case("default (query) 15% (shm)", via(Policy("query"), True)))
    cases.append(Case("default (query) 15% (gRPC)", via(Policy("query"), False)))
    return cases


def measure(cases: list[Case], repeats: int, ref: torch.Tensor, warmup: int = 1) -> None:
    """`warmup` untimed rounds of the cases (allocator, first Locate, probe), then `repeats`
    rounds of samples: TTFT, its split, and the logits' deviation from full prefill."""
    def sample(case: Case) -> None:
        ttft, r, rep = case.run()
        s = {"ttft_s": ttft, "computed_share": r.computed_share if r else 1.0,
             "recompute_ratio": r.recompute_ratio if r else 0.0,
             "reused_chunks": getattr(rep, "reused_chunks", 0), "budget": getattr(rep, "budget", 0.0),
             "blend_skipped": getattr(rep, "blend_skipped", False),
             **_split(ttft, r, getattr(rep, "fetch_wait_s", 0.0))}
        if r is not None:
            s["logit_dev"] = float((r.logits - ref).norm() / ref.norm())
        case.samples.append(s)

    for _ in range(warmup):
        for case in cases:
            case.run()
    for _ in range(repeats):
        for case in cases:
            sample(case)


def _prefix_cases(work: Workload, client: KVClient, model_id: str) -> list[Case]:
    """The prefix cache: exact variants of the first 3 chunks stored, as a request with the
    same leading chunks stores them (the plan prefers them: CFO 0)."""
    chunks = work.chunks
    k = min(3, len(chunks) - 1)
    lead = blend_prefill(work.engine, [Segment(c) for c in chunks[:k]], Policy("full"), InMemoryLayerSource({}),
                         gate=TRUSTED).fresh
    for i in range(k):
        client.store(model_id, chunks[i], lead[i].kv, prefix_keys=list(lead[i].prefix), stats=lead[i].stats)
    return [Case(f"prefix, {k} of {len(chunks)} chunks (shm)", via_adapter(work, client, Policy("prefix"), True)),
            Case(f"prefix, {k} of {len(chunks)} chunks (gRPC)", via_adapter(work, client, Policy("prefix"), False))]


def _rows(cases: list[Case]) -> list[dict]:
    """Each case's medians and its speedups over the two full prefills (the first two cases)."""
    hf_s = median(cases[0], "ttft_s")
    eng_s = median(cases[1], "ttft_s")
    rows = []
    for c in cases:
        med = {k: median(c, k) for k in c.samples[0]}
        rows.append({"case": c.name, "group": c.group, **med,
                     "speedup_vs_transformers": hf_s / med["ttft_s"], "speedup_vs_engine_full": eng_s / med["ttft_s"],
                     "ideal_speedup": 1.0 / med["computed_share"], "samples": c.samples})
    return rows


def run(work: Workload, repeats: int, data_dir: Path) -> dict:
    """One prompt's rows: every case's medians over `repeats` samples."""
    from kvservice.launcher import ServiceProcess

    engine = work.engine
    model_id = engine.model_spec().fingerprint()
    tokens = torch.tensor(sum(work.chunks, []) + work.question)
    ref = engine.prefill(tokens, all_logits=False, kv=False)[0][-1]
    with ServiceProcess(data_dir) as service, KVClient(service.address) as client:
        ranking = store_chunks(engine, client, model_id, work)
        cases = _cases(work, client, tokens, ranking)
        measure(cases, repeats, ref)
        prefix = _prefix_cases(work, client, model_id)
        measure(prefix, repeats, ref)
        cases += prefix
    return {"title": work.title, "shape": work.shape, "rows": _rows(cases)}


def median(c: Case, key: str) -> float:
    return statistics.median(s[key] for s in c.samples if key in s) if any(key in s for s in c.samples) else float("nan")


def print_table(out: dict, repeats: int, threads: int) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"TTFT, {out['title']}; {threads} torch thread(s); median of {repeats}")
    cols = ("case", "TTFT ms", "vs transformers", "vs engine full", "computed", "ideal", "fetch wait",
            "rotate", "recompute", "attention", "logits", "other", "logit dev")
    for col in cols:
        t.add_column(col, justify="left" if col == "case" else "right")
    for r in out["rows"]:
        ms = lambda k: f"{r[k] * 1e3:.0f}" if r["group"] != "full" else "-"  # noqa: E731
        t.add_row(r["case"], f"{r['ttft_s'] * 1e3:.0f}", f"{r['speedup_vs_transformers']:.1f}x",
                  f"{r['speedup_vs_engine_full']:.1f}x", f"{r['computed_share']:.1%}", f"{r['ideal_speedup']:.1f}x",
                  ms("fetch_wait"), ms("rotate"), ms("recompute"), ms("attention"), ms("logits"), ms("other"),
                  f"{r['logit_dev']:.3f}" if "logit_dev" in r and r["logit_dev"] == r["logit_dev"] else "-")
    Console(width=200).print(t)


if __name__ == "__main__":
    raise SystemExit(main())
