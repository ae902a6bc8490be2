"""MuSiQue on the real model (SmolLM2-135M-Instruct), every reuse policy served as deployed.

    kvcraft bench real-quality [--data musique_s.json] [--first 0 --prompts 10] [--passages 3]
        [--new-tokens 32] [--policy full naive cacheblend:budget=0.15 ...] [--json OUT] [--plot OUT.png]

Prompts and metrics come from `kvbench.common.musique` (CacheBlend's MuSiQue layout in the chat
template: an instruction segment, one segment per passage, the question). One kvcraft
service (its own process, the product's default configuration, a temporary data folder)
serves the whole run, and the records arrive as one stream of requests, in order. For each:

1. warm: the record's passages reversed, behind a passage of the previous record (of the
   next, for the first), served by full prefill through `RAGAdapter` with store-back on,
   and waited for (`flush`): each passage's stored variant was computed behind other
   passages, as a cache holds it after serving other requests;
2. the record in its own order, once per policy, through `RAGAdapter` with store-back off
   (no policy sees another's variants), then greedy decoding of `--new-tokens` over the
   blended cache (`engine_adapter.generate.greedy`, stop tokens from the model folder);
3. a full prefill of the same tokens by transformers (SDPA, fp32), timed in the same run:
   the reference for the TTFT speed-up.

Policy `full` through the adapter is the fidelity reference: every other policy's answer
is compared with its answer (ROUGE-L, identical answers, first token). The warm requests
learn no recompute lists (`learn=False`): in this stream the only chunk computed a second
time is the neighbour passage, of a record already evaluated, so a list would serve no
measured request, and learning one for a ~600-token passage costs minutes on a CPU.

Policies are given as specs: a name from `engine_adapter.policy.POLICIES`, then options
of that policy as `:key=value[,key=value]` (`cacheblend:budget=0.15`,
`cachecraft:focus_window=2`); `parse_policy` refuses anything else.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from engine_adapter import policy
from engine_adapter.policy import ReusePolicy
from kvbench import results
from kvbench.common import musique
from kvbench.common.args import count

DEFAULT_POLICIES = ("full", "naive", "cacheblend:budget=0.15", "cachecraft", policy.DEFAULT_POLICY)
REFERENCE = "full"
# Per-policy columns of the summary (JSON keys; the markdown table shows them in this order).
COLUMNS = {
    "f1": "F1",
    "exact_match": "EM",
    "rouge_l_vs_full": "ROUGE-L vs full",
    "identical_to_full": "identical to full",
    "first_token_agrees": "first token = full",
    "computed_share": "row-layers computed",
    "ttft_s": "mean TTFT (s)",
    "speedup_vs_transformers": "speed-up vs transformers",
}


@dataclass(frozen=True)
class PolicySpec:
    spec: str  # as given: the policy's label in every output
    policy: ReusePolicy


def parse_policy(spec: str) -> PolicySpec:
    """`name` or `name:key=value[,key=value]` -> the policy; ValueError says what is wrong."""
    return PolicySpec(spec.strip(), policy.parse_policy(spec))


def policy_specs(specs: Sequence[str]) -> list[PolicySpec]:
    """Parsed specs, the reference `full` first (added when missing); a repeated spec is refused."""
    parsed = [parse_policy(s) for s in specs]
    labels = [p.spec for p in parsed]
    if len(set(labels)) != len(labels):
        raise ValueError(f"a policy spec is given twice: {labels}")
    ref = [p for p in parsed if p.spec == REFERENCE]
    return (ref or [parse_policy(REFERENCE)]) + [p for p in parsed if p.spec != REFERENCE]


def run(model_dir: Path, records: Sequence[musique.Record], specs: Sequence[str] = DEFAULT_POLICIES,
        new_tokens: int = 32, progress: bool = True) -> dict:
    """The benchmark over `records` as one stream (see the module docstring): summary rows
    per policy (`COLUMNS`), every record's answers, and the run's metadata."""
    import torch
    from rich.console import Console
    from rich.progress import track
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from engine_adapter import LlamaEngine
    from engine_adapter.generate import greedy, stop_tokens
    from engine_adapter.rag import RAGAdapter
    from kvclient.client import KVClient
    from kvservice.launcher import ServiceProcess

    policies = policy_specs(specs)
    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = LlamaEngine.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    stop = stop_tokens(model_dir)
    prompts = [musique.prompt(tok, r) for r in records]
    out = []
    with torch.no_grad(), tempfile.TemporaryDirectory(prefix="kvcraft-musique-") as tmp, \
            ServiceProcess(Path(tmp) / "data") as service, KVClient(service.address) as client:
        warm = RAGAdapter(engine, client, policy.Policy("full"))
        items = range(len(records))
        for i in (track(items, description="MuSiQue records", console=Console(stderr=True))
                  if progress else items):
            p = prompts[i]
            warm.prefill(warm_chunks(prompts, i), p.question, reorder=False)
            warm.flush()
            served = {}
            for ps in policies:
                # no shadow prefills: full prefill is this benchmark's own reference, and a
                # shadow would run beside the next policy's timed request
                adapter = RAGAdapter(engine, client, ps.policy, store_back=False, local=True,
                                     shadows=False)
                result, report = adapter.prefill(p.chunks(), p.question, reorder=False)
                gen = greedy(engine, result.logits, result.kv, new_tokens, stop)
                served[ps.spec] = {"answer": tok.decode(gen.tokens, skip_special_tokens=True).strip(),
                                   "tokens": list(gen.tokens), "ttft_s": report.ttft_s,
                                   "computed_share": result.computed_share, "fallbacks": len(result.fallbacks)}
            ids = torch.tensor([p.tokens])
            t0 = time.perf_counter()
            hf(ids, logits_to_keep=1)
            out.append(_score(records[i], len(p.tokens), time.perf_counter() - t0, served))
        warm.close()
    return {"meta": meta(model_dir, len(records), new_tokens, torch.get_num_threads()),
            "policies": summarize(out, [p.spec for p in policies]), "records": out}


def warm_chunks(prompts: Sequence[musique.Prompt], i: int) -> list[tuple[int, ...]]:
    """Record i's warm request: the instruction, a passage of the previous record (of the
    next, for the first; none when alone), then record i's passages reversed."""
    j = i - 1 if i > 0 else i + 1
    neighbour = [prompts[j].passages[0]] if 0 <= j < len(prompts) else []
    return [prompts[i].instruction, *neighbour, *reversed(prompts[i].passages)]


def _score(record: musique.Record, prompt_tokens: int, transformers_s: float, served: dict) -> dict:
    ref = served[REFERENCE]
    for got in served.values():
        got["f1"] = musique.f1(got["answer"], record.answers)
        got["exact_match"] = musique.exact_match(got["answer"], record.answers)
        got["rouge_l_vs_full"] = musique.rouge_l(got["answer"], ref["answer"])
        got["identical_to_full"] = float(got["tokens"] == ref["tokens"])
        got["first_token_agrees"] = float(got["tokens"][:1] == ref["tokens"][:1])
    return {"id": record.id, "question": record.question, "gold": list(record.answers),
            "prompt_tokens": prompt_tokens, "transformers_prefill_s": transformers_s, "served": served}


def standard_error(xs: Sequence[float]) -> float:
    """The standard error of the mean of xs (sample standard deviation / sqrt(n); 0 below 2)."""
    return statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else 0.0


def rouge_l_stats(records: Sequence[dict], label: str, reference: str | None) -> dict:
    """`label`'s ROUGE-L vs full: its standard error and, with a `reference` label, the paired
    difference from it record by record (mean, standard error: the records are shared, so the
    pairing removes what they have in common)."""
    rouge = [r["served"][label]["rouge_l_vs_full"] for r in records]
    out = {"rouge_l_se": standard_error(rouge)}
    if reference is not None:
        diff = [x - r["served"][reference]["rouge_l_vs_full"] for x, r in zip(rouge, records)]
        out["rouge_l_vs_default"], out["rouge_l_vs_default_se"] = statistics.fmean(diff), standard_error(diff)
    return out


def summarize(records: Sequence[dict], labels: Sequence[str]) -> list[dict]:
    """One row per policy: means over the records; the speed-up is mean transformers
    prefill time over the policy's mean TTFT. ROUGE-L vs full carries its standard error and,
    where the default policy ran too, the paired difference from it (`rouge_l_stats`)."""
    hf_s = statistics.fmean(r["transformers_prefill_s"] for r in records)
    default = policy.DEFAULT_POLICY if policy.DEFAULT_POLICY in labels else None
    rows = []
    for label in labels:
        got = [r["served"][label] for r in records]
        row = {"policy": label, "records": len(got)}
        for key in COLUMNS:
            if key != "speedup_vs_transformers":
                row[key] = statistics.fmean(g[key] for g in got)
        row["speedup_vs_transformers"] = hf_s / row["ttft_s"]
        row["fallbacks"] = sum(g["fallbacks"] for g in got)
        row.update(rouge_l_stats(records, label, default if label != default else None))
        rows.append(row)
    return rows


def meta(model_dir: Path, n: int, new_tokens: int, threads: int) -> dict:
    """A run's settings: the model, sizes, torch threads and transformers' version (the machine,
    date and command are the results file's, `kvbench.results`)."""
    import transformers

    return {"model": Path(model_dir).name, "records": n, "new_tokens": new_tokens, "threads": threads,
            "transformers": transformers.__version__}


def table(result: dict) -> str:
    """The summary as a markdown table, with the transformers reference under it."""
    names = list(COLUMNS.values())
    names[3:3] = ["s.e.", "vs the default, paired (s.e.)"]
    lines = ["| policy | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for row in result["policies"]:
        paired = (f"{row['rouge_l_vs_default']:+.3f} ({row['rouge_l_vs_default_se']:.3f})"
                  if "rouge_l_vs_default" in row else "")
        cells = [f"{row['f1']:.3f}", f"{row['exact_match']:.1%}", f"{row['rouge_l_vs_full']:.3f}",
                 f"{row['rouge_l_se']:.3f}", paired, f"{row['identical_to_full']:.0%}", f"{row['first_token_agrees']:.0%}",
                 f"{row['computed_share']:.1%}", f"{row['ttft_s']:.2f}", f"{row['speedup_vs_transformers']:.2f}x"]
        lines.append(f"| {row['policy']} | " + " | ".join(cells) + " |")
    recs = result["records"]
    lines.append("")
    lines.append(f"{len(recs)} records, {statistics.fmean(r['prompt_tokens'] for r in recs):.0f} prompt tokens on "
                 f"average; transformers SDPA full prefill: "
                 f"{statistics.fmean(r['transformers_prefill_s'] for r in recs):.2f} s mean")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """ROUGE-L against full's answer and F1 against gold, each vs the row-layers computed: one
    line per policy through its budgets, and the issue's goals (ROUGE-L 0.90, F1 98% of
    full's, at most 15% computed) as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families: dict[str, list[dict]] = {}
    for row in result["policies"]:
        family = re.sub(r",?budget=[0-9.]+", "", row["policy"]).rstrip(":").replace(":,", ":")  # one line per budget sweep
        families.setdefault(family, []).append(row)
    full_f1 = next(r["f1"] for r in result["policies"] if r["policy"] == REFERENCE)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, key, label, goal in ((axes[0], "rouge_l_vs_full", "ROUGE-L F1 vs full prefill's answer", 0.90),
                                 (axes[1], "f1", "answer F1 vs gold", 0.98 * full_f1)):
        for name, rows in families.items():
            rows = sorted(rows, key=lambda r: r["computed_share"])
            ax.plot([100 * r["computed_share"] for r in rows], [r[key] for r in rows], "o-", ms=5, label=name)
        ax.axhline(goal, color="grey", ls="--", lw=0.8)
        ax.axvline(15, color="grey", ls="--", lw=0.8)
        ax.set_xlim(0, 105)
        ax.set_xlabel("prompt row-layers computed, % of full prefill")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"MuSiQue, SmolLM2-135M-Instruct, {result['meta']['records']} records, through the service "
                 "(dashed: the goals)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def _policy_arg(spec: str) -> str:
    try:
        parse_policy(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    p = argparse.ArgumentParser(prog="kvcraft bench real-quality", description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=musique.SAMPLE,
                   help="a MuSiQue file: musique_s.json of YaoJiayi/CacheBlend (default: the 30 dev records)")
    p.add_argument("--first", type=count(0), default=0, help="index of the first record served")
    p.add_argument("--prompts", type=count(), help="records served (default: all from --first)")
    p.add_argument("--passages", type=count(), default=3, help="passages per prompt, the record's first")
    p.add_argument("--new-tokens", type=count(), default=32)
    p.add_argument("--policy", nargs="+", type=_policy_arg, default=list(DEFAULT_POLICIES), metavar="SPEC",
                   help="e.g. full naive cacheblend:budget=0.15 cachecraft:focus_window=2 (full is always run)")
    p.add_argument("--threads", type=count(), default=1, help="torch threads (transformers and the engine alike)")
    p.add_argument("--model-dir", help="the model folder (default: as `kvcraft model fetch`; fetched if absent)")
    results.add_argument(p, "real-quality")
    p.add_argument("--plot", type=Path)
    a = p.parse_args(argv)
    try:
        policy_specs(a.policy)
    except ValueError as e:
        p.error(str(e))
    import torch

    from kvbench.common.realmodel import fetch

    torch.set_num_threads(a.threads)
    records = musique.load(a.data, passages=a.passages)
    records = records[a.first:None if a.prompts is None else a.first + a.prompts]
    if not records:
        p.error(f"no records from index {a.first} in {a.data}")
    result = run(fetch(a.model_dir).path, records, a.policy, a.new_tokens)
    print(table(result))
    results.save("real-quality", argv, result, a.json)
    if a.plot:
        plot(result, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
