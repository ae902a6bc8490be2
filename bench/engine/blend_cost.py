"""What a blend costs beside exact reuse and full prefill, by how much of the prompt is stored.

    kvcraft bench blend-cost --passages 5 --stored 0 1 2 3 4 5 --repeats 2

The real model (SmolLM2-135M-Instruct, the folder `kvcraft model fetch` builds, fetched if
absent) on a MuSiQue record of the sample with `--passages` passages (the next records'
beyond its own three). For each count k of `--stored`, on a fresh service: the instruction
stored alone (exactly what a prefix cache holds) and the first k passages each stored behind
the instruction and a passage of another record (stored, not exact: what only a blend
reuses). Then the prompt is served, the cases interleaved, `--repeats` times each after
`--warmup` untimed rounds (1: the first request maps the service's shared memory):

- full prefill: the engine alone;
- exact reuse: the `prefix` policy (the instruction from storage, the rest computed);
- the default policy forced to each budget of `--budgets` (a policy named runs as named):
  5%, where the fidelity controller settles on MuSiQue, and 25%, its cold start;
- as deployed: the adaptive adapter at its Plan's budget (a fresh service's cold start),
  which blends or serves exact reuse as the cost gate says (`engine_adapter.cost`); no shadow
  prefills, so unmeasured, as most of a settled model's requests are (a measured one blends).

Each row gives the share of exact reuse's rows (those past the instruction) that are stored,
what the gate reads at each budget (`cost.planned_share`: the rows the blend computes over exact
reuse's; it blends under `cost.BLEND_LIMIT`) and every case's TTFT (median) beside full
prefill's. One torch thread by default, as `kvcraft bench ttft`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import torch

from engine_adapter import Policy
from engine_adapter.cost import BLEND_LIMIT, planned_share
from kvbench import results
from kvbench.common.args import count
from kvbench.engine.ttft import Case, Workload, measure, median, real_workload, store_chunks, timed, via_adapter
from kvclient.client import KVClient


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    ap = argparse.ArgumentParser(prog="kvcraft bench blend-cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, metavar="DIR", help="the real model's folder (default: `kvcraft model "
                                                                 "fetch`'s)")
    ap.add_argument("--record", type=count(0), default=0, help="the MuSiQue sample record")
    ap.add_argument("--passages", type=count(), default=5, help="retrieved passages in the prompt")
    ap.add_argument("--stored", type=count(0), nargs="+", default=None,
                    help="passages stored before the prompt is served, one run each (default: 0 to --passages)")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.05, 0.25])
    ap.add_argument("--repeats", type=count(), default=2)
    ap.add_argument("--warmup", type=count(0), default=1, help="untimed rounds of the cases first")
    ap.add_argument("--threads", type=count(), default=1)
    results.add_argument(ap, "blend-cost")
    a = ap.parse_args(argv)
    stored = a.stored if a.stored is not None else list(range(a.passages + 1))
    if any(not 0 <= k <= a.passages for k in stored):
        ap.error(f"--stored counts must lie in 0..{a.passages} (--passages), got {stored}")
    if any(not 0 < b < 1 for b in a.budgets):
        ap.error(f"--budgets must lie in (0, 1), got {a.budgets}")
    torch.set_num_threads(a.threads)
    work = real_workload(a.model, a.record, a.passages)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvcraft-blend-cost-") as tmp:
        for k in stored:
            rows.append(run(work, k, a.budgets, a.repeats, Path(tmp) / f"data{k}", a.warmup))
            print_row(rows[-1])
    out = {"title": work.title, "shape": work.shape, "repeats": a.repeats, "warmup": a.warmup, "threads": a.threads,
           "blend_limit": BLEND_LIMIT, "rows": rows}
    results.save("blend-cost", argv, out, a.json)
    return 0


def run(work: Workload, k: int, budgets: Sequence[float], repeats: int, data_dir: Path, warmup: int) -> dict:
    """The prompt served with the instruction and its first `k` passages stored: each case's
    median TTFT, its share of row-layers computed and whether the deployed adapter blended."""
    from kvservice.launcher import ServiceProcess

    engine = work.engine
    tokens = torch.tensor(sum(work.chunks, []) + work.question)
    ref = engine.prefill(tokens, all_logits=False, kv=False)[0][-1]
    with ServiceProcess(data_dir) as service, KVClient(service.address) as client:
        store_chunks(engine, client, engine.model_spec().fingerprint(),
                     dataclasses.replace(work, chunks=work.chunks[:k + 1], behind=work.behind[:k + 1]))
        cases = [Case("full prefill", timed(lambda: engine.prefill(tokens, all_logits=False)), "full"),
                 Case("exact reuse", via_adapter(work, client, Policy("prefix"), True)),
                 *(Case(f"blend {b:.0%}", via_adapter(work, client, Policy("query", budget=b), True))
                   for b in budgets),
                 Case("as deployed", via_adapter(work, client, None, True))]
        measure(cases, repeats, ref, warmup)
    full_s = median(cases[0], "ttft_s")
    n, lens = len(tokens), [len(c) for c in work.chunks]
    deployed = cases[-1].samples[-1]
    return {"stored_passages": k, "passages": len(lens) - 1, "prompt_tokens": n,
            "stored_share": sum(lens[1:k + 1]) / (n - lens[0]),
            "planned_share": {f"{b:g}": planned_share(n, lens[:k + 1], lens[0], b) for b in budgets},
            "deployed_blended": not deployed["blend_skipped"], "deployed_budget": deployed["budget"],
            "cases": [{"case": c.name, "ttft_s": median(c, "ttft_s"), "vs_full": full_s / median(c, "ttft_s"),
                       "computed_share": median(c, "computed_share"), "logit_dev": median(c, "logit_dev")}
                      for c in cases]}


def print_row(row: dict) -> None:
    cells = ", ".join(f"{c['case']} {c['ttft_s'] * 1e3:.0f} ms ({c['vs_full']:.2f}x)" for c in row["cases"])
    print(f"{row['stored_passages']} of {row['passages']} passages stored (share {row['stored_share']:.0%}; "
          f"deployed {'blended' if row['deployed_blended'] else 'exact reuse'}): {cells}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
