"""Answer quality as deployed: a fresh service, its defaults, a stream of requests, nothing learned.

    kvcraft bench deployed --task short --examples 300
    kvcraft bench deployed --task long --examples 200 --policy cacheblend:budget=0.15

One fresh `kvcraft serve` (the embedded default configuration, an empty data dir) and one
`RAGAdapter` with the product's defaults (store-back on: every chunk a request computes is
stored with its statistics) serve a stream, each request once, in order. For each
held-out example i (draw `--seed`, default 1: no choice was made on it):

  1. a request that retrieved i's chunks among 2 chunks of example i+1, shuffled, with i's
     question (the chunks recur later in another order and context);
  2. example i as retrieved: its chunks in their order, its question.

Nothing is warmed: the first request computes everything, later ones reuse what earlier
ones stored (request 1 of example i+1 finds two of its chunks stored by request 1 of i).
CRAFT reorder is off: in these tasks chunk order carries meaning ("they" is the person
named last before), which docs/planner.md says to declare per request. Beside every
request, the reference engine's full prefill of the same prompt.

Reported over the whole stream (first requests included): agreement of the answer (the
greedy first token: answers are one word) with full prefill's, exact match against the gold
answer on the kind-2 requests (policy and full prefill), the share of row-layers computed
(every request, and the kind-2 requests alone; layer 0 and the question counted).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from rich.progress import track

from engine_adapter import LlamaEngine, ReusePolicy
from engine_adapter.policy import DEFAULT_POLICY, parse_policy
from engine_adapter.rag import RAGAdapter
from kvbench import results
from kvbench.common.args import count
from kvbench.quality import data, longdata
from kvbench.quality.modeling import LONG_MODEL_DIR, MODEL_DIR, build_tokenizer, encode
from kvclient.client import KVClient
from kvservice.launcher import ServiceProcess

TASKS = {"short": (data, MODEL_DIR), "long": (longdata, LONG_MODEL_DIR)}


@dataclass
class Stream:
    """Counts over one stream."""

    requests: int = 0
    agree: int = 0  # answer == full prefill's on the same prompt
    asked: int = 0  # kind-2 requests (the example as retrieved)
    correct: int = 0  # of those, the policy's answer is the gold answer
    full_correct: int = 0  # ... and full prefill's
    computed: list[float] = field(default_factory=list)  # per request, share of row-layers computed
    computed_asked: list[float] = field(default_factory=list)
    computed_asked_whole: list[float] = field(default_factory=list)  # of those, requests with no late layer
    fallbacks: int = 0  # requests in which a stored layer came late (> layer_budget_s) and was computed

    def summary(self) -> dict:
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        return {"requests": self.requests, "agreement_with_full": self.agree / self.requests,
                "accuracy": self.correct / self.asked, "full_accuracy": self.full_correct / self.asked,
                "of_full": self.correct / self.full_correct if self.full_correct else 0.0,
                "computed_share": mean(self.computed), "computed_share_as_retrieved": mean(self.computed_asked),
                "computed_share_as_retrieved_without_fallbacks": mean(self.computed_asked_whole),
                "requests_with_fallbacks": self.fallbacks}


def requests(task: str, n: int, seed: int) -> list[tuple[list[list[int]], list[int], int | None]]:
    """The stream: (chunks, question, gold first answer token or None) per request."""
    mod, _ = TASKS[task]
    tok = build_tokenizer(mod.vocabulary())
    enc = [encode(tok, e) for e in mod.examples("heldout", n + 1, seed=seed)]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        mixed = [list(c) for c in enc[i].chunk_ids] + [list(c) for c in enc[i + 1].chunk_ids[:2]]
        rng.shuffle(mixed)
        out.append((mixed, list(enc[i].question_ids), None))
        out.append(([list(c) for c in enc[i].chunk_ids], list(enc[i].question_ids), enc[i].answer_ids[0]))
    return out


@torch.no_grad()
def run(task: str, n: int, policy: ReusePolicy, seed: int = 1, progress: bool = True, label: str = "") -> dict:
    _, model_dir = TASKS[task]
    engine = LlamaEngine.from_pretrained(model_dir)
    stream = Stream()
    reqs = requests(task, n, seed)
    with tempfile.TemporaryDirectory(prefix="kvcraft-deployed-") as tmp:
        with ServiceProcess(Path(tmp) / "data") as service, KVClient(service.address) as client:
            adapter = RAGAdapter(engine, client, policy)
            for chunks, question, gold in (track(reqs, description=f"{task}: {policy.name}") if progress else reqs):
                result, _ = adapter.prefill(chunks, question, reorder=False)
                adapter.flush()  # the next request sees what this one stored, as a slower stream would
                full = engine.prefill(torch.tensor([t for c in chunks for t in c] + question), all_logits=False, kv=False)[0][-1]
                answer, expected = int(result.logits.argmax()), int(full.argmax())
                stream.requests += 1
                stream.agree += answer == expected
                stream.computed.append(result.computed_share)
                stream.fallbacks += bool(result.fallbacks)
                if gold is not None:
                    stream.asked += 1
                    stream.correct += answer == gold
                    stream.full_correct += expected == gold
                    stream.computed_asked.append(result.computed_share)
                    if not result.fallbacks:
                        stream.computed_asked_whole.append(result.computed_share)
            adapter.close()
    return {"task": task, "examples": n, "seed": seed, "policy": label or str(policy), **stream.summary()}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    p = argparse.ArgumentParser(prog="kvcraft bench deployed", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=sorted(TASKS), default="short")
    p.add_argument("--examples", type=count(), default=300)
    p.add_argument("--seed", type=count(0), default=1)
    p.add_argument("--policy", action="append", help=f"policy spec, e.g. naive or cacheblend:budget=0.15 "
                                                     f"(repeatable; default: {DEFAULT_POLICY})")
    results.add_argument(p, "deployed")
    a = p.parse_args(argv)
    specs = a.policy or [DEFAULT_POLICY]
    try:
        policies = [parse_policy(s) for s in specs]
    except ValueError as e:
        p.error(str(e))
    rows = [run(a.task, a.examples, pol, a.seed, label=spec) for spec, pol in zip(specs, policies)]
    print(f"{'policy':<26} {'agree':>6} {'acc':>6} {'full':>6} {'of full':>8} {'computed':>9} {'as retrieved':>13} "
          f"{'fallbacks':>9}")
    for r in rows:
        print(f"{r['policy']:<26} {r['agreement_with_full']:>6.1%} {r['accuracy']:>6.1%} {r['full_accuracy']:>6.1%} "
              f"{r['of_full']:>8.1%} {r['computed_share']:>9.1%} {r['computed_share_as_retrieved']:>13.1%} "
              f"{r['requests_with_fallbacks']:>9}")
    results.save("deployed", argv, {"task": a.task, "examples": a.examples, "seed": a.seed, "rows": rows}, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
