"""Results views of time to first token (kvbench.engine.ttft) and of the vLLM benchmarks
(kvbench.vllm): each renders one benchmark's results files as the pages show them."""

from __future__ import annotations

from kvbench.report.markdown import num, pct, sources, table, times

Named = list[tuple[str, dict]]
SPLIT = ("fetch_wait", "rotate", "recompute", "attention", "logits", "other")


def ttft(named: Named) -> str:
    """Every case of each prompt: TTFT, speed-up, share computed and where the time went."""
    out = []
    for _, r in named:
        for run in r["runs"]:
            rows = []
            for c in run["rows"]:
                full = c["group"] == "full"
                dev = c.get("logit_dev")
                rows.append([c["case"], num(c["ttft_s"] * 1e3, 0), times(c["speedup_vs_transformers"]),
                             pct(c["computed_share"]), times(c["ideal_speedup"]),
                             *("-" if full else num(c[k] * 1e3, 0) for k in SPLIT),
                             "-" if dev is None or dev != dev else num(dev, 3)])
            out.append(f"{run['title']}; median of {r['repeats']}:\n\n" + table(
                ["case", "TTFT ms", "vs transformers", "row-layers computed", "ideal", "fetch wait", "rotate",
                 "recompute", "attention", "logits", "other", "logit dev"], rows))
    return "\n\n".join(out) + f"\n\n{sources(named)}"


def blend_cost(named: Named) -> str:
    """Per count of passages stored: the share stored, what the cost gate reads at each budget
    (the rows a blend computes over exact reuse's), what the adapter as deployed served, and
    every case's TTFT beside full prefill's."""
    out = []
    for _, r in named:
        limit, names = r["blend_limit"], [c["case"] for c in r["rows"][0]["cases"]]
        budgets = list(r["rows"][0]["planned_share"])
        body = [[f"{row['stored_passages']} of {row['passages']}", pct(row["stored_share"], 0),
                 " · ".join(f"{pct(p, 0)} {'blend' if p < limit else 'exact'}"
                            for p in (row["planned_share"][b] for b in budgets)),
                 "blend" if row["deployed_blended"] else "exact reuse",
                 *(f"{num(c['ttft_s'] * 1e3, 0)} ({times(c['vs_full'], 2)})" for c in row["cases"])]
                for row in r["rows"]]
        gate = f"the gate at {' · '.join(pct(float(b), 0) for b in budgets)}"
        out.append(f"{r['title']}; median of {r['repeats']}, {r['threads']} torch thread(s). The gate blends where "
                   f"the blend computes under {pct(limit, 0)} of exact reuse's rows; as deployed, at a fresh "
                   f"service's budget ({pct(r['rows'][0]['deployed_budget'], 0)}). TTFT ms (speed-up over full "
                   "prefill):\n\n" + table(["passages stored", "stored", gate, "as deployed, served by", *names], body))
    return "\n\n".join(out) + f"\n\n{sources(named)}"


def ttft_lengths(named: Named) -> str:
    """TTFT per policy at each prompt length (the plot's numbers)."""
    (_, r), = named
    runs = r["runs"]
    rows = [[case, *(num(ms, 0) for ms in series)] for case, series in lengths_series(runs).items()]
    head = ["TTFT ms", *(f"{run['shape']['prompt_tokens']:,} tokens" for run in runs)]
    return f"{runs[0]['title'].split(',')[0]}, median of {r['repeats']}:\n\n" + table(head, rows) + f"\n\n{sources(named)}"


def lengths_series(runs: list[dict]) -> dict[str, list[float]]:
    """TTFT ms per case across the runs (prompt lengths), for the cases every run has."""
    per = [{c["case"]: c["ttft_s"] * 1e3 for c in run["rows"]} for run in runs]
    return {case: [p[case] for p in per] for case in per[0] if all(case in p for p in per)}


def vllm_ttft(named: Named) -> str:
    (_, r), = named
    rows = [[x["mode"], f"{num(x['ttft_ms_p50'], 0)} / {num(x['ttft_ms_p99'], 0)}", x.get("ttft_ms_n", x["requests"]),
             "-" if x["mode"] == "vLLM alone" else times(x["speedup_p50"], 2), pct(x["computed_share"])]
            for x in r["rows"]]
    sh = r["shape"]
    return (table(["mode", "TTFT p50 / p99 ms", "requests (n)", "vs vLLM alone at p50", "token-layers computed"], rows)
            + f"\n\nA random-weight {sh['layers']}-layer Llama (hidden {sh['hidden']}), {sh['chunks']} chunks x "
              f"{sh['chunk_len']} tokens + a {sh['question_len']}-token question, one request at a time."
            + memory_sentence(r.get("memory")) + "\n\n" + sources(named))


def memory_sentence(m: dict | None) -> str:
    """The vllm-ttft run's engine memory (`kvbench.vllm.ttft`), one sentence after a space; "" without."""
    if not m:
        return ""
    return (f" Peak resident memory of the engine process: vLLM alone {num(m['alone_peak_rss_mib'], 0)} MiB, "
            f"vLLM + kvcraft {num(m['blend_peak_rss_mib'], 0)} MiB ({m['added_share_of_weights']:+.1%} of the "
            f"weights' {num(m['weights_mib'], 0)} MiB); "
            + (f"right after the last request, private memory {num(m['alone_anon_before_rest_mib'], 0)} and "
               f"{num(m['blend_anon_before_rest_mib'], 0)} MiB; at rest (freed heap handed back: kvcraft's idle "
               f"trim, the same malloc_trim in vLLM alone) " if "blend_anon_before_rest_mib" in m else "at the end, ")
            + f"private memory {num(m['alone_anon_mib'], 0)} "
            f"and {num(m['blend_anon_mib'], 0)} MiB ({m['added_private_share_of_weights']:+.1%} of the weights), "
            f"the service's shared segments touched {num(m['blend_shmem_mib'], 0)} MiB.")


def vllm_concurrency(named: Named) -> str:
    (_, r), = named
    modes = list(dict.fromkeys(x["mode"] for x in r["rows"]))
    levels = list(dict.fromkeys(x["concurrent"] for x in r["rows"]))
    by = {(x["mode"], x["concurrent"]): x for x in r["rows"]}
    top = max(levels)
    rows = []
    for m in modes:
        last = by[m, top]
        rows.append([m, *(num(by[m, c]["requests_per_s"], 2) for c in levels), num(last["wall_s"], 1),
                     num(last["blend_s_over_wall"], 2) if "blend_s_over_wall" in last else "-",
                     f"{num(last['queue_s_mean'], 1)} s" if "queue_s_mean" in last else "-"])
    return table(["mode", *(f"{c} at once: req/s" for c in levels), f"wall s at {top}", f"blend / wall at {top}",
                  f"mean queue at {top}"], rows) + f"\n\n{sources(named)}"


def vllm_quality(named: Named) -> str:
    (_, r), = named
    rows = []
    for x in r["rows"]:
        ref = x.get("reference") or {}
        rows.append([x["setting"], pct(x["vllm"]["accuracy"]), pct(ref.get("accuracy")),
                     pct(x["vllm"]["computed_share"])])
    return (table(["setting", "vLLM", "kvcraft's reference engine", "computed (vLLM path)"], rows)
            + f"\n\n{r['examples']} held-out prompts of the synthetic task, the committed quality model.\n\n"
            + sources(named))


def vllm_real(named: Named) -> str:
    rows = []
    for name, r in named:
        for x in r["rows"]:
            rows.append([x["setting"], f"{round(x['identical_to_vllm_alone'] * x['records'])}/{x['records']}",
                         f"{round(x['identical_to_reference'] * x['records'])}/{x['records']}",
                         num(x["rouge_l_vs_full"], 3), pct(x["computed_share"]), name])
    return table(["setting", "= vLLM alone", "= reference engine", "ROUGE-L vs vLLM alone", "computed (vLLM path)",
                  "results"], rows) + f"\n\n{sources(named)}"


def vllm_real_adaptive(named: Named) -> str:
    (_, r), = named
    rows = []
    for x in r["rows"]:
        n = x["records"]
        budgets = x.get("budgets", {}).get("requests_per_budget")
        rows.append([x["setting"], f"{round(x['identical_to_vllm_alone'] * n)}/{n}",
                     f"{round(x['identical_to_reference'] * n)}/{n}",
                     f"{num(x['rouge_l_vs_full'], 3)} / {num(x.get('reference_rouge_l_vs_full', x['rouge_l_vs_full']), 3)}",
                     f"{pct(x['computed_share'])} / {pct(x['reference_computed_share'])}",
                     ", ".join(f"{b} ({k})" for b, k in budgets.items()) if budgets else "-",
                     f"{x.get('budgets', {}).get('sampled', 0)} / {x.get('reference_budgets', {}).get('sampled', 0)}"])
    return table(["setting", "= vLLM alone", "= reference engine", "ROUGE-L vs vLLM alone: vLLM path / reference",
                  "computed: vLLM path / reference", "budgets (requests)", "sampled: vLLM path / reference"],
                 rows) + f"\n\n{sources(named)}"


def vllm_rag(named: Named) -> str:
    (_, r), = named
    rows = [[x["mode"], pct(x["computed_share_of_prompt"]), pct(x["chunk_computed_share"]), f"{x['hit_tokens']:,}",
             f"{x['dropped_chunk_tokens']:,}", f"{num(x['ttft_ms_p50'], 0)} / {num(x['ttft_ms_p99'], 0)}"]
            for x in r["rows"]]
    return (table(["mode", "prompt tokens computed", "chunk tokens computed (of retrieved)", "tokens from a cache",
                   "dropped (dedup)", "TTFT p50 / p99 ms"], rows)
            + f"\n\n{r['trace_requests']} requests, {r['rows'][0]['retrieved_chunk_tokens']:,} retrieved chunk tokens"
              f" ({r['config']['conversations']} conversations of the default trace).\n\n{sources(named)}")


VIEWS = {"ttft": ttft, "ttft-lengths": ttft_lengths, "blend-cost": blend_cost, "vllm-ttft": vllm_ttft,
         "vllm-concurrency": vllm_concurrency,
         "vllm-quality": vllm_quality, "vllm-real": vllm_real, "vllm-real-adaptive": vllm_real_adaptive,
         "vllm-rag": vllm_rag}
