"""How close any choice of recomputed rows comes on the real model: selections made with full
prefill's KV in hand (oracles no deployment has), beside naive reuse and the default policy.

    kvcraft bench real-bound [--data musique_s.json] [--first 0 --prompts 100] [--passages 1]
        [--budgets 0.15 0.3 0.5] [--greedy] [--ape T,S ...] [--only ID ...] [--new-tokens 16] [--json OUT]

`kvbench.quality.real_quality` measures the policies as deployed; none keeps ROUGE-L >= 0.90 against
full prefill's answer at <= 15% of the row-layers computed (docs/quality.md). This asks
whether a better selection could: per record, the rows of the reused passages to recompute
from layer 0 are chosen knowing what full prefill computes, three ways (four with --greedy):

  deviation   the rows whose stored K and V deviate most from full prefill's, summed over
              the layers (each layer's squared deviation over its mean squared norm):
              CacheBlend's HKVD criterion (§4.2) with the true deviation at every layer in
              place of its estimate from one layer;
  reads       the rows the question reads most in full prefill (attention of the question
              rows summed over heads, rows and layers 1..L-2), with the default's chunk
              heads (`query.most_read`): ProphetKV's query-aware criterion with the true
              attention in place of the question pass's over stale KV;
  free question pass
              the default's own picks (its question pass over the stored KV) without
              paying for that pass: what the default keeps if it cost nothing;
  greedy      (with --greedy) blocks of GREEDY_BLOCK consecutive passage rows added one at a
              time, each the block whose recompute brings the last position's next-token
              distribution closest to full prefill's (KL(full || blend), every remaining block
              tried: the true effect, not an estimate); a budget gets the blocks added before
              it is spent. At a block's grain: a row's would take ~64x the blends. Its rows
              and the prompt's segment edges are kept per record (`rows`, `edges`): where
              the picks lie (`kvbench.report.quality.oracle`).

With --ape, APE's attention (`policies.ape`: naive reuse, the question and the answer reading
the reused passages with temperature T and scale S) at each T,S given, twice: over the stored
variants above, and over each passage encoded behind the instruction alone (APE's shared
prefix; "behind the instruction"), beside naive reuse of those.

Beside them, full prefill in bfloat16 (the precision GPUs serve in) against full prefill in
fp32: how far a change that keeps every row exact in all but rounding moves the answers.

Each gets `budget` of the prompt's row-layers with the question paid once (the default pays
it twice), so n = budget x N - |question| rows through every layer. The prompts are
`kvbench.quality.real_quality`'s with as many `--passages` (instruction, ~600-token passages, question),
and so are the stored variants, computed here in process (no service: the bound is about the
selection, not the serving): the instruction's behind nothing (exact), each passage's behind the
instruction, a passage of the neighbouring record (the previous; the next, for the first) and
the record's later passages, as `real_quality`'s warm request (the passages reversed) leaves them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor

from engine_adapter import LlamaEngine
from engine_adapter.blend import BlendResult, blend_prefill, prefill_with_picks, question_reads, run_passes
from engine_adapter.fidelity import compare
from engine_adapter.generate import greedy, stop_tokens
from engine_adapter.near_tie import lead
from engine_adapter.policy import DEFAULT_POLICY, Naive, Policy, QueryAware
from engine_adapter.probe import TRUSTED
from engine_adapter.prompt import Layout, Segment
from engine_adapter.policies.picks import QuestionReads, candidate_rows, most_read
from engine_adapter.selection import Rescale
from engine_adapter.source import InMemoryLayerSource
from kvbench import results
from kvbench.common import musique
from kvbench.common.args import count
from kvbench.report.quality import musique_table
from kvbench.quality.real_quality import meta, rouge_l_stats, warm_chunks

BUDGETS = (0.15, 0.3, 0.5)
GREEDY_BLOCK = 64  # passage rows the greedy search adds at a time
COLUMNS = {"rouge_l_vs_full": "ROUGE-L vs full", "identical_to_full": "identical to full",
           "first_token_agrees": "first token = full", "answer_forced_agrees": "answer, teacher forced",
           "f1": "F1", "computed_share": "row-layers computed"}


def run(model_dir: Path, records: Sequence[musique.Record], budgets: Sequence[float] = BUDGETS,
        new_tokens: int = 16, progress: bool = True, search: bool = False,
        apes: Sequence[tuple[float, float]] = (), only: Sequence[int] = ()) -> dict:
    """The rows per case (`COLUMNS`, means over the records) and every record's answers. only: the
    ids of the records to run (default: all), each still with its neighbour's passage from `records`."""
    from rich.console import Console
    from rich.progress import track
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = LlamaEngine.from_pretrained(model_dir)
    # bf16 on a CPU is slow: its row is a run of its own (no budgets, no APE)
    bf16 = None if budgets or apes else LlamaEngine.from_pretrained(model_dir, dtype=torch.bfloat16)
    stop = stop_tokens(model_dir)
    prompts = [musique.prompt(tok, r) for r in records]
    out = []
    items = [i for i, r in enumerate(records) if not only or r.id in only]
    with torch.no_grad():
        for i in (track(items, description="MuSiQue records", console=Console(stderr=True)) if progress else items):
            served = _record(engine, bf16, prompts, i, budgets, new_tokens, stop, search, apes)
            for got in served.values():
                got["answer"] = tok.decode(got["tokens"], skip_special_tokens=True).strip()
            out.append(_score(records[i], served))
    return {"meta": meta(model_dir, len(records), new_tokens, torch.get_num_threads()),
            "cases": summarize(out), "records": out}


def summarize(records: Sequence[dict]) -> list[dict]:
    """One row per case: `COLUMNS` averaged over the records, the standard errors of ROUGE-L
    and of first-token agreement, the paired difference from the default policy per record
    (mean, standard error), and the records' count."""
    labels = list(records[0]["served"]) if records else []
    default = f"{DEFAULT_POLICY} (default)"
    rows = []
    for label in labels:
        first = [r["served"][label]["first_token_agrees"] for r in records]
        se = statistics.stdev(first) / len(first) ** 0.5 if len(first) > 1 else 0.0
        rows.append({"case": label, **{k: statistics.fmean(r["served"][label][k] for r in records) for k in COLUMNS},
                     **rouge_l_stats(records, label, default), "first_token_se": se, "records": len(records)})
    return rows


@dataclass(frozen=True)
class Served:
    """A record's prompt with the stored variants a reuse policy would be served."""

    segments: list[Segment]  # the instruction, the passages (all cached), the question
    layout: Layout
    stored: dict[int, list[tuple[Tensor, Tensor]]]  # segment -> the stored variant's per-layer (K RoPE-free, V)

    def source(self) -> InMemoryLayerSource:
        """The stored variants, fresh for each prefill."""
        return InMemoryLayerSource(self.stored)

    @property
    def reused(self) -> list[int]:
        """The stored segments: the instruction and the passages."""
        return sorted(self.stored)


def served(engine: LlamaEngine, prompts: Sequence[musique.Prompt], i: int) -> Served:
    """Record i with the variants `real_quality`'s warm request leaves (its chunks: the
    instruction, the neighbour's passage, the record's passages reversed, computed in full)."""
    model_id = engine.model_spec().fingerprint()
    p = prompts[i]
    warm = [Segment(c) for c in warm_chunks(prompts, i)]
    warmed = run_passes(engine, Layout.of(warm, model_id), Policy("full"), InMemoryLayerSource({}), [])
    mine = [warmed.fresh[len(warm) - 1 - k] for k in range(len(p.passages))]  # passage k's variant
    segments = [Segment(p.instruction, cached=True),
                *(Segment(c, cached=True, cached_prefix=v.prefix) for c, v in zip(p.passages, mine)),
                Segment(p.question, question=True)]
    stored = {0: warmed.fresh[0].kv} | {1 + k: v.kv for k, v in enumerate(mine)}
    return Served(segments, Layout.of(segments, model_id), stored)


def behind_instruction(engine: LlamaEngine, s: Served, p: musique.Prompt) -> Served:
    """`s` with each passage's variant encoded behind the instruction alone (APE's shared prefix)."""
    model_id = engine.model_spec().fingerprint()
    stored = {0: s.stored[0]}
    segments = [s.segments[0]]
    for k, passage in enumerate(p.passages):
        alone = run_passes(engine, Layout.of([Segment(p.instruction), Segment(passage)], model_id), Policy("full"),
                           InMemoryLayerSource({}), [])
        stored[1 + k] = alone.fresh[1].kv
        segments.append(Segment(passage, cached=True, cached_prefix=alone.fresh[1].prefix))
    segments.append(s.segments[-1])
    return Served(segments, Layout.of(segments, model_id), stored)


def oracle_scores(engine: LlamaEngine, s: Served, full: BlendResult, naive: BlendResult) -> dict[str, Tensor]:
    """Per prompt row [N], what the oracles rank the passages' rows by (module docstring):
    `deviation` (stored vs full prefill's K/V, zero outside the passages) and `reads` (the
    question's attention in full prefill, layers 1..L-2). full: `s`'s full prefill (with its
    fresh variants), naive: its naive reuse."""
    span = slice(s.layout.edges[1], s.layout.edges[-2])  # the passages
    deviation = torch.zeros(s.layout.n)
    for (fk, fv), (nk, nv) in zip(full.kv, naive.kv):
        fk, fv, nk, nv = (x[:, span].float() for x in (fk, fv, nk, nv))
        norm = (fk.pow(2).sum((0, 2)) + fv.pow(2).sum((0, 2))).mean()
        deviation[span] += ((fk - nk).pow(2).sum((0, 2)) + (fv - nv).pow(2).sum((0, 2))) / norm
    # The passages as full prefill computed them (behind the instruction and each other): the
    # question pass over them reads what full prefill's question reads.
    exact = InMemoryLayerSource({0: s.stored[0]} | {j: full.fresh[j].kv for j in s.reused if j})
    return {"deviation": deviation, "reads": question_reads(engine, s.layout, exact, s.reused, layer_budget_s=1.0).reads}


def greedy_blocks(kl: Callable[[list[int]], float], blocks: Sequence[Sequence[int]], rows: int) -> list[list[int]]:
    """Forward selection: blocks in the order added, each the one whose rows joined to those
    added before give the lowest `kl(rows)`, while the rows added fit in `rows` (ties: the
    earlier block)."""
    left, added, taken = [list(b) for b in blocks], [], []
    while True:
        tried = [(kl(sorted(taken + b)), j) for j, b in enumerate(left) if len(taken) + len(b) <= rows]
        if not tried:
            return added
        _, j = min(tried)
        added.append(left.pop(j))
        taken += added[-1]


def passage_blocks(q: QuestionReads, lay: Layout, size: int = GREEDY_BLOCK) -> list[list[int]]:
    """The rows a selection may pick (`candidate_rows`), each segment's in runs of `size`
    consecutive ones."""
    candidates = candidate_rows(q, lay).tolist()
    out = []
    for seg in range(len(lay.segments)):
        rows = [r for r in range(*lay.edges[seg:seg + 2]) if candidates[r]]
        out += [rows[a:a + size] for a in range(0, len(rows), size)]
    return out


def with_rows(engine: LlamaEngine, s: Served, q: QuestionReads, rows: Sequence[int]) -> BlendResult:
    """The prefill that recomputes exactly `rows` (prompt rows among `q`'s live ones) through
    every layer after the question pass `q`."""
    score = torch.zeros(s.layout.n)
    score[list(rows)] = 1.0
    picks = most_read(QuestionReads(score, q.live, q.result, q.layer0), s.layout, len(rows), heads=False,
                      num_layers=engine.cfg.num_layers)
    return prefill_with_picks(engine, s.layout, q, picks, s.source(), stats=False)


def _record(engine: LlamaEngine, bf16: LlamaEngine | None, prompts: Sequence[musique.Prompt], i: int,
            budgets: Sequence[float], new_tokens: int, stop: frozenset[int], search: bool = False,
            apes: Sequence[tuple[float, float]] = ()) -> dict[str, dict]:
    """Record i's answers per case: tokens and computed share. bf16: the engine in bfloat16,
    whose full prefill measures how far another precision moves an answer (None: no such row).
    search: the greedy search's rows at each budget too (`greedy_blocks`). apes: APE's cases at
    each (T, S) (the module docstring)."""
    L = engine.cfg.num_layers
    s = served(engine, prompts, i)
    lay, question = s.layout, len(prompts[i].question)
    out = {}

    def answer(label: str, result: BlendResult, rescale: Rescale | None = None) -> None:
        decoded(label, engine, result.logits, result.kv, result.computed_share, rescale)

    def decoded(label: str, model: LlamaEngine, logits: Tensor, kv: list, share: float,
                rescale: Rescale | None = None) -> None:
        """Its answer, its picks fed full prefill's answer (teacher forcing: `forced`; full
        prefill's own, the first, fed its own picks: the same tokens), and its first token's
        margin: the logit of its top next token over the runner-up's."""
        tokens = list(greedy(model, logits, kv, new_tokens, stop, rescale=rescale).tokens)
        forced = list(greedy(model, logits, kv, new_tokens, stop, feed=out["full"]["tokens"],
                             rescale=rescale).tokens) if out else tokens
        out[label] = {"tokens": tokens, "forced": forced, "computed_share": share, "margin": lead(logits)}

    full = run_passes(engine, lay, Policy("full"), InMemoryLayerSource({}), [])
    answer("full", full)
    if bf16 is not None:  # bf16 on a CPU is slow: its row is a run of its own (no budgets)
        logits, kv = bf16.prefill(lay.tokens, all_logits=False)
        decoded("full, bf16", bf16, logits[-1], kv, 1.0)
    naive = run_passes(engine, lay, Naive(), s.source(), s.reused)
    answer("naive", naive)
    answer(f"{DEFAULT_POLICY} (default)", blend_prefill(engine, s.segments, Policy(DEFAULT_POLICY), s.source(),
                                                        gate=TRUSTED, stats=False))
    if apes:
        shared = behind_instruction(engine, s, prompts[i])
        answer("naive, behind the instruction",
               run_passes(engine, shared.layout, Naive(), shared.source(), shared.reused))
        for t, scale in apes:
            ape = Policy("ape", temperature=t, scale=scale)
            for where, v in (("", s), (", behind the instruction", shared)):
                answer(f"ape T={t:g} S={scale:g}{where}", run_passes(engine, v.layout, ape, v.source(), v.reused),
                       ape.rescale(v.layout))
    if not budgets:
        return out
    oracle = oracle_scores(engine, s, full, naive)
    asked = question_reads(engine, lay, s.source(), s.reused, layer_budget_s=1.0)
    rows_at = {b: max(0, int(b * lay.n) - question) for b in budgets}  # through every layer; the question paid once
    path = []
    if search:
        path = greedy_blocks(lambda rows: compare(full.logits, with_rows(engine, s, asked, rows).logits)[1],
                             passage_blocks(asked, lay), max(rows_at.values()))
    for b in budgets:
        policy = QueryAware(budget=b)
        n = rows_at[b]
        for name, score, heads in (("deviation", oracle["deviation"], False), ("reads", oracle["reads"], True),
                                   ("free question pass", asked.reads, True)):
            q = QuestionReads(score, asked.live, asked.result, asked.layer0)
            picks = most_read(q, lay, n, heads=heads, num_layers=L, depth=policy.head_depth(L))
            answer(f"{name} {b:.0%}", prefill_with_picks(engine, lay, q, picks, s.source(), stats=False))
        if search:
            rows: list[int] = []
            for block in path:
                if len(rows) + len(block) > n:
                    break
                rows += block
            answer(f"greedy {b:.0%}", with_rows(engine, s, asked, sorted(rows)))
            out[f"greedy {b:.0%}"] |= {"rows": sorted(rows), "edges": list(lay.edges)}  # where the oracle's picks lie
    return out


def _score(record: musique.Record, served: dict) -> dict:
    ref = served["full"]
    for got in served.values():
        got["f1"] = musique.f1(got["answer"], record.answers)
        got["rouge_l_vs_full"] = musique.rouge_l(got["answer"], ref["answer"])
        got["identical_to_full"] = float(got["tokens"] == ref["tokens"])
        got["first_token_agrees"] = float(got["tokens"][:1] == ref["tokens"][:1])
        # of full prefill's answer tokens, the share this case predicts when fed the ones before
        got["answer_forced_agrees"] = statistics.fmean(int(a == b) for a, b in zip(got["forced"], ref["tokens"]))
    return {"id": record.id, "question": record.question, "gold": list(record.answers), "served": served}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    p = argparse.ArgumentParser(prog="kvcraft bench real-bound", description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=musique.SAMPLE,
                   help="a MuSiQue file: musique_s.json of YaoJiayi/CacheBlend (default: the 30 dev records)")
    p.add_argument("--first", type=count(0), default=0, help="index of the first record")
    p.add_argument("--prompts", type=count(), help="records (default: all from --first)")
    p.add_argument("--passages", type=count(), default=1, help="passages per prompt, the record's first")
    p.add_argument("--budgets", type=float, nargs="*", default=list(BUDGETS), metavar="SHARE",
                   help="shares of the prompt's row-layers each selection may compute (0 < share <= 1); "
                        "none: only full prefill (fp32 and bf16), naive reuse and the default")
    p.add_argument("--greedy", action="store_true",
                   help="also the greedy search's rows at each budget (tens of blends a record per budget step)")
    p.add_argument("--ape", nargs="*", default=[], metavar="T,S",
                   help="APE's attention at each temperature,scale, over the stored variants and over passages "
                        "encoded behind the instruction alone")
    p.add_argument("--only", type=count(0), nargs="+", default=[], metavar="ID",
                   help="run only these records (ids: indices in --data) of the range, each with the same "
                        "neighbour's passage as in a run of the whole range")
    p.add_argument("--new-tokens", type=count(), default=16)
    p.add_argument("--threads", type=count(), default=2, help="torch threads")
    p.add_argument("--model-dir", help="the model folder (default: as `kvcraft model fetch`; fetched if absent)")
    results.add_argument(p, "real-bound")
    a = p.parse_args(argv)
    if not all(0 < b <= 1 for b in a.budgets):
        p.error(f"--budgets must lie in (0, 1], got {a.budgets}")
    try:
        apes = [tuple(float(x) for x in pair.split(",", 1)) for pair in a.ape]
        for t, scale in apes:
            Policy("ape", temperature=t, scale=scale)
    except ValueError as e:
        p.error(f"--ape must be T,S pairs (0 < T <= 1, S > 0), got {a.ape}: {e}")
    from kvbench.common.realmodel import fetch

    torch.set_num_threads(a.threads)
    records = musique.load(a.data, passages=a.passages)[a.first:]
    records = records[:a.prompts]
    if len(records) < 2:
        p.error(f"fewer than 2 records from index {a.first} in {a.data} (each needs a neighbour's passage)")
    if missing := sorted(set(a.only) - {r.id for r in records}):
        p.error(f"--only must name records of the range, got {missing} outside {records[0].id}-{records[-1].id}")
    result = run(fetch(a.model_dir).path, records, a.budgets, a.new_tokens, search=a.greedy, apes=apes,
                 only=a.only)
    print(musique_table(result))
    results.save("real-bound", argv, result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
