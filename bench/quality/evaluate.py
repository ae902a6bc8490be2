"""Answer quality of each reuse policy, with chunk caches from other requests' contexts,
through the real service (the planner, leases and layer streams a deployment runs).

For every held-out example:
  1. warm: a request with the example's chunks shuffled among a neighbour example's
     chunks is served by full prefill, and every chunk's KV is stored back with its
     attention statistics — so each stored variant was computed behind another prefix;
     For the learned lists, two more warm passes (other shuffles) compute every chunk
     again behind new prefixes, asking another example's question: their store-backs send
     learned recompute scores (`engine_adapter.learned.learn` against an earlier variant,
     merged). Passes no deployment runs: `kvbench.quality.deployed` measures as deployed;
  2. evaluate: the example in its retriever order, once per policy, through
     RAGAdapter (Plan -> fetch layer by layer -> blend), nothing stored back. Only
     the CRAFT setting lets the planner reorder the chunks (in this task chunk order
     carries meaning: "they" refers to the friend named in the chunk before).
The answer is one word, so exact match is the greedy first token. The reference engine
runs the trained weights (`kvbench.quality.modeling.MODEL_DIR`).

    kvcraft bench evaluate --examples 200 [--plot PNG]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from rich.progress import track

from engine_adapter import LlamaEngine, Policy, ReuseGate
from engine_adapter.policy import DEFAULT_POLICY, parse_policy
from engine_adapter.rag import RAGAdapter
from kvbench import results
from kvbench.common.args import count
from kvbench.quality import data
from kvbench.quality.modeling import MODEL_DIR, build_tokenizer, encode
from kvclient.client import KVClient
from kvcraft.keys import chunk_key
from kvservice.launcher import ServiceProcess
from kvservice.planner.variants import DEFAULT_ALPHA


@dataclass(frozen=True)
class Setting:
    label: str
    policy: Policy
    reorder: bool = False  # CRAFT reorder of the first turn (changes the prompt)
    alpha: float = 1.0  # Cache-Craft eq. 12 alpha of the service
    learn: int = 0  # warm passes after the first computing every chunk again: learned recompute scores


DEFAULT = parse_policy(DEFAULT_POLICY)  # the policy a deployment runs unless told otherwise
DEFAULT_LABEL = f"{DEFAULT.label()} (default)"

SETTINGS = (
    Setting("full prefill", Policy("full")),
    Setting("prefix (exact prefix only)", Policy("prefix")),
    Setting("CRAFT reorder + prefix", Policy("prefix"), reorder=True),
    Setting("naive (reuse all, recompute none)", Policy("naive")),
    *(Setting(f"cacheblend r={int(r * 100)}%", Policy("cacheblend", ratio=r)) for r in (0.05, 0.10, 0.15, 0.30)),
    *(Setting(f"cachecraft alpha={a}", Policy("cachecraft"), alpha=a) for a in (0.25, 0.5, 1.0)),
    Setting("cachecraft alpha=1.0 + focus (w=2)", Policy("cachecraft", focus_window=2)),
    Setting("cachecraft + learned lists (2 offline passes)", Policy("cachecraft"), alpha=DEFAULT_ALPHA, learn=2),
    Setting(DEFAULT_LABEL, DEFAULT),
)


def evaluate(n_examples: int, settings: Sequence[Setting] = SETTINGS, model_dir: Path = MODEL_DIR,
             seed: int = 1, progress: bool = True) -> list[dict]:
    engine = LlamaEngine.from_pretrained(model_dir)
    tok = build_tokenizer()
    exs = data.examples("heldout", n_examples + 1, seed=seed)
    enc = [encode(tok, e) for e in exs]
    L = engine.cfg.num_layers
    rows = []
    # One service per (alpha, reorder): CRAFT's reorder changes which variants and
    # chunk-prefixes the warm requests leave behind, so it gets its own history.
    groups: dict[tuple[float, bool, int], list[Setting]] = {}
    for s in settings:
        groups.setdefault((s.alpha, s.reorder, s.learn), []).append(s)
    for (alpha, reorder, learn), group in groups.items():
        with tempfile.TemporaryDirectory(prefix="kvcraft-quality-") as tmp:
            with ServiceProcess(Path(tmp) / "data", cfo_alpha=alpha) as service, KVClient(service.address) as client:
                _warm(engine, client, enc, seed, reorder, learn=False)
                for k in range(learn):
                    _warm(engine, client, enc, seed + 1 + k, reorder, learn=True)
                stats = {s.label: _Tally() for s in group}
                items = range(n_examples)
                for i in (track(items, description=f"alpha={alpha} reorder={reorder} learn={learn}")
                          if progress else items):
                    e = enc[i]
                    chunks = [list(c) for c in e.chunk_ids]
                    answer = e.answer_ids[0]
                    for s in group:
                        # Quality, not speed: a layer late on a loaded machine is waited for
                        # (computing it instead would change what is measured).
                        policy = dataclasses.replace(s.policy, layer_budget_s=LAYER_WAIT_S)
                        adapter = RAGAdapter(engine, client, policy, gate=_GATE, store_back=False,
                                             shadows=False)  # its own reference below
                        result, rep = adapter.prefill(chunks, list(e.question_ids), reorder=s.reorder)
                        ordered = _in_order(engine, chunks, rep.order)
                        ref = engine.prefill(torch.tensor([t for c in ordered for t in c] + list(e.question_ids)), kv=False)[0][-1]
                        stats[s.label].add(
                            correct=int(result.logits.argmax()) == answer,
                            kind=exs[i].kind,
                            computed=sum(result.computed_rows) if result.timings else rep.prompt_tokens * L,
                            prompt=rep.prompt_tokens * L,
                            recomputed=sum(result.recomputed_rows),
                            reused=result.reused_tokens * L,
                            dev=float((result.logits - ref).abs().max() / ref.abs().max()),
                        )
                for s in group:
                    rows.append({"setting": s.label, "alpha": alpha, **stats[s.label].summary()})
    return rows


_GATE = ReuseGate()
LAYER_WAIT_S = 30.0  # longest wait for a stored layer during evaluation


def _warm(engine: LlamaEngine, client: KVClient, enc: list, seed: int, reorder: bool, learn: bool = False) -> None:
    """Every example's chunks computed and stored behind other prefixes (and, with
    reorder, in the order CRAFT gives those requests). learn: store-back sends learned
    recompute scores where a variant of the chunk is already stored (a second pass with
    another shuffle: each chunk computed in full behind a new prefix, asked that
    request's question)."""
    rng = random.Random(seed)
    warm = RAGAdapter(engine, client, Policy("full"), gate=_GATE, learn=learn)
    for i in range(len(enc) - 1):
        mixed = [list(c) for c in enc[i].chunk_ids] + [list(c) for c in enc[i + 1].chunk_ids[:2]]
        rng.shuffle(mixed)
        # A learning pass asks the next example's question: lists are never fitted to the
        # question they are later scored on.
        question = enc[i + 1 if learn else i].question_ids
        warm.prefill(mixed, list(question), reorder=reorder)
    warm.close()


def _in_order(engine: LlamaEngine, chunks: list[list[int]], keys: Sequence[str]) -> list[list[int]]:
    model_id = engine.model_spec().fingerprint()
    by_key = {chunk_key(model_id, c): c for c in chunks}
    return [by_key[k] for k in keys]


class _Tally:
    def __init__(self) -> None:
        self.n = self.correct = 0
        self.by_kind: dict[str, list[int]] = {}
        self.computed = self.prompt = self.recomputed = self.reused = 0
        self.devs: list[float] = []

    def add(self, *, correct: bool, kind: str, computed: int, prompt: int, recomputed: int, reused: int,
            dev: float) -> None:
        self.n += 1
        self.correct += correct
        k = self.by_kind.setdefault(kind, [0, 0])
        k[0] += correct
        k[1] += 1
        self.computed += computed
        self.prompt += prompt
        self.recomputed += recomputed
        self.reused += reused
        self.devs.append(dev)

    def summary(self) -> dict:
        return {
            "examples": self.n,
            "accuracy": self.correct / self.n,
            "accuracy_by_kind": {k: c / n for k, (c, n) in sorted(self.by_kind.items())},
            "computed_share": self.computed / self.prompt,
            "recomputed_share_of_reused": self.recomputed / self.reused if self.reused else 0.0,
            "first_token_logit_dev_mean": sum(self.devs) / len(self.devs),
        }


def plot(rows: list[dict], path: Path) -> None:
    """Accuracy vs prompt tokens computed: CacheBlend and Cache-Craft as lines over their
    parameter, every other setting a labelled point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    xy = lambda r: (100 * r["computed_share"], 100 * r["accuracy"])  # noqa: E731
    families = {"cacheblend": "o", "cachecraft": "s"}  # prefix of the setting -> marker
    series = lambda r: r["setting"].split()[0] if "focus" not in r["setting"] else None  # noqa: E731
    for family, marker in families.items():
        members = sorted((r for r in rows if series(r) == family), key=lambda r: r["computed_share"])
        pts = [xy(r) for r in members]
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker=marker, label=family)
        for r, pt in zip(members, pts):
            ax.annotate(r["setting"].removeprefix(family).strip(), pt, fontsize=7,
                        xytext=(4, -10), textcoords="offset points")
    for r in rows:
        if series(r) in families:
            continue
        ax.scatter(*xy(r), s=30, color="black", zorder=3)
        ax.annotate(r["setting"].split(" (")[0], xy(r), fontsize=7, xytext=(4, 3), textcoords="offset points")
    full = next(r["accuracy"] for r in rows if r["setting"] == "full prefill")
    ax.axhline(100 * 0.98 * full, color="gray", ls="--", lw=0.8)
    ax.text(1, 100 * 0.98 * full - 2.5, "98% of full-prefill accuracy", fontsize=7, color="gray")
    ax.set_xlim(0, 108)
    ax.set_xlabel("prompt tokens computed, % of full prefill (rows x layers)")
    ax.set_ylabel("exact-match accuracy, %")
    ax.set_title("Answer quality vs computation: trained 4-layer Llama, chunk caches from other requests, "
                 "through the service", fontsize=9)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    p = argparse.ArgumentParser(prog="kvcraft bench evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=count(), default=200)
    p.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    results.add_argument(p, "evaluate")
    p.add_argument("--plot", type=Path)
    a = p.parse_args(argv)
    torch.set_grad_enabled(False)
    rows = evaluate(a.examples, model_dir=a.model_dir)
    w = max(len(r["setting"]) for r in rows)
    print(f"{'setting':<{w}} {'acc':>6} {'computed':>9} {'recomp/reused':>14} {'logit dev':>10}  by kind")
    for r in rows:
        kinds = " ".join(f"{k}={v:.2f}" for k, v in r["accuracy_by_kind"].items())
        print(f"{r['setting']:<{w}} {r['accuracy']:>6.3f} {r['computed_share']:>9.3f} "
              f"{r['recomputed_share_of_reused']:>14.3f} {r['first_token_logit_dev_mean']:>10.4f}  {kinds}")
    results.save("evaluate", argv, {"examples": a.examples, "rows": rows}, a.json)
    if a.plot:
        plot(rows, a.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
