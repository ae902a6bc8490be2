"""Results views of the fidelity streams (kvbench.quality.fidelity_stream): each stream's tables,
and every stream's summary in one table."""

from __future__ import annotations

import re

from kvbench.report.markdown import pct, sources, table

Named = list[tuple[str, dict]]
ANSWER_TOKENS = 16  # answer tokens compared under teacher forcing: engine_adapter.fidelity's (fidelity_stream checks)


def answers_line(a: dict, tokens: int = ANSWER_TOKENS) -> str:
    """The answers' agreement under teacher forcing: whole stream, settled, and per budget the
    service's tally against the truth of all its requests."""
    per = "; ".join(f"{h['budget']:.2f}: service {ratio(h.get('service_answer_agreement'))}, true "
                    f"{ratio(h['true_answer_agreement'])}" for h in a["honesty"])
    return (f"Answers under teacher forcing (the first {tokens} tokens after the first): true agreement "
            f"{ratio(a['overall']['answer_agreement'])} over the stream ({a['overall']['answer_tokens']} tokens), "
            f"{ratio(a['settled']['answer_agreement'])} settled; per budget, {per}.")


def label(meta: dict) -> str:
    """The stream's task, with its passages a prompt for MuSiQue (a file written before `meta` kept
    them: from its last command's `--passages`, 3 by default), and its near-tie gate where it is not
    the default's (the margin the service learns)."""
    gate = ("" if meta.get("near_tie") == "learned" else ", no near-tie gate" if not meta.get("near_tie") else
            f", near ties under {meta['near_tie']:g} served by full prefill")
    if meta["task"] != "musique":
        return meta["task"] + gate
    given = re.search(r"--passages (\d+)", meta["commands"][-1])
    return f"musique, {meta.get('passages', int(given.group(1)) if given else 3)} passages{gate}"


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def fixed_runs(runs: list[dict]) -> set[int]:
    """The request counts of a stream's fixed-policy runs (its sweep; neither the adaptive run
    nor full prefill); empty where none ran (`--sweep none`)."""
    return {t["requests"] for t in runs if not t["policy"].startswith(("full", "adaptive"))}


def stream_tables(result: dict) -> str:
    """A stream's report as tables: the adaptive run, each budget's samples against the truth, the
    fixed policies; "smallest fixed budget" under them."""
    rep, meta_ = result["report"], result["meta"]
    a, s = rep["adaptive"], rep["sweep"]
    st, c = a["settled"], a["sampling_cost"]
    moves = ", ".join(f"{t['to']:.2f} from request {t['request']}" for t in a["trajectory"])
    state = ", ".join(f"{b['budget']:.2f} {b['state']}" for b in a["service_budgets"])
    # The answers' column where any run compared answers under teacher forcing (`--new-tokens`).
    answers = any(r.get("answer_tokens") for r in (a["overall"], *s["table"]))
    head = ("| true agreement (s.e.) | computed | computed, as retrieved | TTFT (ms) |"
            + (f" answers, first {ANSWER_TOKENS} tokens (teacher forced) |" if answers else ""))
    rule = "|---|---|---|---|---|---|" + ("---|" if answers else "")

    def cells(r: dict) -> str:
        return (f"{r['agreement']:.3f} ({r['se']:.3f}) | {pct(r['computed_share'])} | "
                f"{pct(r.get('computed_share_as_retrieved', 1.0))} | {r['ttft_s'] * 1e3:.1f} |"
                + (f" {ratio(r.get('answer_agreement'))} |" if answers else ""))

    lines = [f"**{label(meta_)}** ({a['requests']} requests, {meta_['prompt_tokens_mean']:.0f} prompt tokens on "
             f"average): budget {moves}; at the end the service says {state}.", "",
             "| adaptive run | requests " + head, rule]
    if parts := result["runs"][0].get("parts"):  # `--state`: stopped and gone on with
        lines[0] += (f" Served in {len(parts)} parts: the service restarted on its data (and the engine's adapter "
                     f"afresh) before request{'s' * (len(parts) > 2)} "
                     + ", ".join(str(p["first_request"]) for p in parts[1:]) + ".")
        if seeded := [str(p["first_request"]) for p in parts if p.get("service_data") == "tallies"]:
            lines[0] += (f" Before request{'s' * (len(seeded) > 1)} {', '.join(seeded)} its data dir was not there "
                         "(another machine): it restarted on the fidelity tallies the benchmark kept, every chunk's "
                         "KV computed again.")
    for name, r in (("whole stream", a["overall"]), (f"settled ({a['settled_budget']:.2f}, from request "
                                                    f"{a['settled_from_request']})", st)):
        lines.append(f"| {name} | {r['requests']} | {cells(r)}")
    speeds = [f"{name}: {r['requests']}, true agreement {r['agreement']:.3f} ({r['se']:.3f}), computed "
              f"{pct(r['computed_share'])}; TTFT {r['ttft_s'] * 1e3:.1f} ms against full prefill's "
              f"{r['full_ttft_s'] * 1e3:.1f} ms on the same requests ({r['timed']} timed): {r['speedup']:.1f}x."
              for name, r in (("Settled requests", a.get("settled_speed")),
                              ("Settled requests as retrieved (every chunk stored before)",
                               a.get("settled_as_retrieved"))) if r is not None]
    learned = [b["near_tie"] for b in a.get("service_budgets", []) if b.get("near_tie")]
    n = a.get("near_ties", {"overall": 0, "settled": 0})
    margin = meta_.get("near_tie") if meta_.get("near_tie") != "learned" else None
    if margin or n["overall"] or learned:
        under = (f"less than {margin} logits" if margin else "less than the margin the service learned (at the "
                 f"end {learned[0]:g} logits)" if learned else "less than the margin the service learned")
        speeds.append(f"Near ties (a blend whose first token leads by {under}) served by full "
                      f"prefill: {n['overall']} of {a['requests']} requests, {n['settled']} of the settled; their "
                      "computed share and TTFT count the blend and full prefill.")
    if (n := a.get("blends_skipped")) and n["overall"]:
        speeds.append(f"Served by exact reuse because too little of them was stored for a blend to pay "
                      f"(`engine_adapter.cost`): {n['overall']} of {a['requests']} requests, {n['settled']} of the "
                      "settled.")
    if speeds:
        lines += ["", " ".join(speeds)]
    lines += ["", f"Sampled {a['sampled']} of {a['requests']} requests ({a['blended']} blended; {a['sampled_after_settle']} "
              f"after the settle; {c.get('shadow_blends', 0)} of the shadows also blended at a budget below); the "
              f"shadows computed {pct(c['row_share'])} of all row-layers (served + shadows), "
              f"{c['shadow_s']:.1f} s beside {c['served_compute_s']:.1f} s of served compute ({c['served_ttft_s']:.1f} s "
              f"of TTFT); TTFT of sampled requests {a['ttft_sampled_s'] * 1e3:.1f} ms, of unsampled "
              f"{a['ttft_unsampled_s'] * 1e3:.1f} ms." + (" " + answers_line(a, ANSWER_TOKENS) if a["overall"].get("answer_tokens")
                                                          else ""), "",
              "| budget | requests served (blended) | service's samples (shadow blends) | Wilson 95% | true, all its "
              "requests | covered | fixed run at that budget | covered |", "|---|---|---|---|---|---|---|---|"]
    for h in a["honesty"]:
        iv = f"[{h['wilson_lower']:.3f}, {h['wilson_upper']:.3f}]" if "wilson_lower" in h else "no samples"
        fewer = f" (its first {h['fixed_requests']} requests)" if h.get("fixed_requests", a["requests"]) < a["requests"] \
            else ""
        fixed = (f"{h['fixed_agreement']:.3f}{fewer} | {'yes' if h['covers_fixed'] else 'no'}" if "covers_fixed" in h
                 else "- | -")
        served = (f"{h['true_agreement_all']:.3f} | {'yes' if h.get('covers_all') else 'no'}"
                  if h["true_agreement_all"] is not None else "- | -")
        lines.append(f"| {h['budget']:.2f} | {h['requests']} ({h['blended']}) | {h.get('service_samples', 0)} "
                     f"({h.get('service_top1_agree', 0)} agree; {h.get('service_shadow_blends', 0)}) | {iv} | "
                     f"{served} | {fixed} |")
    lines += ["", "| fixed policy | requests " + head, rule]
    for t in s["table"]:
        name = t["policy"] + (f" ({t['timed']} of them timed; the others' full prefill was their shadow)"
                              if t.get("timed", t["requests"]) < t["requests"] else "")
        lines.append(f"| {name} | {t['requests']} | {cells(t)}")
    b = s["smallest_budget_meeting_target"]
    swept = fixed_runs(s["table"])
    if not swept:
        lines += ["", "No fixed budget ran beside it (`--sweep none`)."]
        return "\n".join(lines)
    lines += ["", ("" if swept <= {a["requests"]} else f"(The sweep served the stream's first {min(swept)} requests.) ")
              + "Smallest fixed budget with true agreement >= 0.95: " + (
        "none" if b is None else f"{b:.2f} ({pct(s['its_computed_share'])} computed); the adaptive run's settled "
                                 f"share over it: {s['settled_share_ratio']:.2f}x") + "."]
    return "\n".join(lines)


def stream(named: Named) -> str:
    return "\n\n".join(stream_tables(r) for _, r in named) + f"\n\n{sources(named)}"


def streams_summary(named: Named) -> str:
    """One row per stream: where the budget settled, its true agreement and share computed, against
    the least fixed budget whose true agreement meets the target."""
    rows = []
    for _, r in named:
        m, a, s = r["meta"], r["report"]["adaptive"], r["report"]["sweep"]
        st, least = a["settled"], s["smallest_budget_meeting_target"]
        rows.append([label(m), m["seed"], f"{m['requests']:,}", f"{a['settled_budget']:.2f} ({a['settled_from_request']})",
                     f"{st['agreement']:.3f} ({st['se']:.3f})", pct(st["computed_share"]),
                     "-" if least is None else f"{least:.2f} ({pct(s['its_computed_share'])})",
                     "-" if s["settled_share_ratio"] is None else f"{s['settled_share_ratio']:.2f}x"])
    return table(["stream", "draw", "requests", "settled at (from request)", "true agreement, settled (s.e.)",
                  "computed, settled", "least fixed budget meeting the target (its computed)", "settled / it"],
                 rows) + f"\n\n{sources(named)}"


VIEWS = {"stream": stream, "streams-summary": streams_summary}
