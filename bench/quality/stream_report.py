"""A fidelity stream's report, from its runs' per-request rows (pure: no model, no service;
tests/bench/test_fidelity_stream.py): true agreement, share computed and TTFT, the adaptive run's
trajectory and settle, each budget's service samples against the truth, the fixed-budget sweep
against the adaptive run (kvbench.quality.fidelity_stream runs the streams)."""

from __future__ import annotations

import math
import statistics
from typing import Sequence

from kvbench.report.streams import ANSWER_TOKENS, answers_line, fixed_runs, ratio
from kvservice.fidelity import DEFAULT_TARGET as TARGET
from kvservice.fidelity import ladder_budget


def mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def rate(rows: Sequence[dict], start: int = 0) -> dict:
    """True agreement of rows with its standard error sqrt(p(1-p)/n), computed share, TTFT;
    the computed share of the requests as retrieved (every chunk stored before: a row's
    `as_retrieved`, else the stream's odd requests; `start`: the index of rows[0] in the
    stream); the answers' true agreement under teacher forcing where they were compared."""
    n = len(rows)
    p = sum(r["agree"] for r in rows) / n if n else float("nan")
    tokens = sum(r.get("answer_tokens", 0) for r in rows)
    return {"requests": n, "agreement": p, "se": math.sqrt(p * (1 - p) / n) if n else float("nan"),
            "computed_share": mean([r["share"] for r in rows]), "ttft_s": mean([r["ttft_s"] for r in rows]),
            "computed_share_as_retrieved": mean([r["share"] for i, r in enumerate(rows, start)
                                                 if r.get("as_retrieved", i % 2 == 1)]),
            "answer_tokens": tokens,
            "answer_agreement": sum(r.get("answer_agree", 0) for r in rows) / tokens if tokens else None}


def trajectory(budgets: Sequence[float]) -> list[dict]:
    """Where the budget moved: the first request's budget, then every change (request index
    it first served, from, to)."""
    out = []
    for i, b in enumerate(budgets):
        if i == 0:
            out.append({"request": 0, "from": None, "to": b})
        elif b != budgets[i - 1]:
            out.append({"request": i, "from": budgets[i - 1], "to": b})
    return out


def settled_from(budgets: Sequence[float]) -> int:
    """Index of the first request of the last run of equal budgets (0: never moved)."""
    i = len(budgets) - 1
    while i > 0 and budgets[i - 1] == budgets[i]:
        i -= 1
    return max(i, 0)


def adaptive_report(run: dict, policy: str) -> dict:
    rows = run["requests"]
    budgets = [ladder_budget(r["budget"]) for r in rows]
    s = settled_from(budgets)
    after = rows[s:]
    sampled = [r for r in rows if r["sampled"]]
    unsampled = [r for r in rows if not r["sampled"]]
    blended_unsampled = [r for r in unsampled if r["blended"]]
    tallies = {ladder_budget(f["budget"]): f for f in run["service"]["fidelity"] if f["policy"] == policy}
    honesty = []
    for b in sorted(set(budgets) | {b for b in tallies if b > 0}):  # served, or measured by shadow blends alone
        at = [r for r in rows if ladder_budget(r["budget"]) == b]
        blended = [r for r in at if r["blended"]]
        mine = [r for r in at if r["sampled"]]
        t = tallies.get(b)
        true_all = sum(r["agree"] for r in at) / len(at) if at else None
        true_blended = sum(r["agree"] for r in blended) / len(blended) if blended else float("nan")
        row = {"budget": b, "requests": len(at), "blended": len(blended), "sampled": len(mine),
               "sampled_agree_by_reference": sum(r["agree"] for r in mine),
               "true_agreement_all": true_all, "true_agreement_blended": true_blended,
               "true_answer_agreement": rate(at)["answer_agreement"] if at else None}
        if t is not None:
            lo, hi = t["agree_lower"], t["agree_upper"]
            row.update(service_samples=t["samples"], service_top1_agree=t["top1_agree"], wilson_lower=lo,
                       wilson_upper=hi, service_shadow_blends=t.get("shadow_blends", 0),
                       covers_all=lo <= true_all <= hi if at else None,
                       covers_blended=(lo <= true_blended <= hi) if blended else None,
                       service_answer_agreement=(t["answer_agree"] / t["answer_tokens"]
                                                 if t.get("answer_tokens") else None))
        honesty.append(row)
    cost = run["sampling_cost"]
    return {
        "requests": len(rows),
        "trajectory": trajectory(budgets),
        "settled_budget": budgets[s] if budgets else None,
        "settled_from_request": s,
        "service_budgets": run["service"]["budgets"],
        "overall": rate(rows),
        "settled": rate(after, s),
        "blended": sum(r["blended"] for r in rows),
        "sampled": len(sampled),
        "sampled_after_settle": sum(r["sampled"] for r in after),
        "sampling_cost": {"row_share": cost["row_share"], "shadow_s": cost["shadow_s"],
                          "shadow_blends": cost.get("shadow_blends", 0),
                          "served_compute_s": cost["served_compute_s"], "shadow_row_layers": cost["shadow_row_layers"],
                          "served_row_layers": cost["served_row_layers"],
                          "served_ttft_s": sum(r["ttft_s"] for r in rows)},
        "ttft_sampled_s": mean([r["ttft_s"] for r in sampled]),
        "ttft_unsampled_s": mean([r["ttft_s"] for r in unsampled]),
        "ttft_unsampled_blended_s": mean([r["ttft_s"] for r in blended_unsampled]),
        "ttft_settled_sampled_s": mean([r["ttft_s"] for r in after if r["sampled"]]),
        "ttft_settled_unsampled_s": mean([r["ttft_s"] for r in after if not r["sampled"] and r["blended"]]),
        "honesty": honesty,
    }


def sweep_report(runs: Sequence[dict], settled_share: float | None, target: float = TARGET) -> dict:
    table = [{"policy": r["policy"], **rate(r["requests"])} for r in runs]
    fixed = [(float(t["policy"].split("budget=")[1]), t) for t in table
             if t["policy"].startswith("query:budget=")]
    meeting = sorted((b, t) for b, t in fixed if t["agreement"] >= target)
    out: dict = {"table": table, "smallest_budget_meeting_target": None, "its_computed_share": None,
                 "settled_share_ratio": None}
    if meeting:
        b, t = meeting[0]
        out.update(smallest_budget_meeting_target=b, its_computed_share=t["computed_share"])
        if settled_share is not None:
            out["settled_share_ratio"] = settled_share / t["computed_share"]
    return out


def speed(rows: Sequence[dict], reference_s: Sequence[float | None], at: Sequence[int]) -> dict | None:
    """Requests `at` (indices into `rows`): their true agreement and computed share, and their TTFT
    beside full prefill's own on the same requests (those the reference timed; the others' full
    prefill was a shadow's)."""
    timed = [i for i in at if reference_s[i] is not None]
    if not timed:
        return None
    served, full = mean([rows[i]["ttft_s"] for i in timed]), mean([reference_s[i] for i in timed])
    p = sum(rows[i]["agree"] for i in at) / len(at)
    return {"requests": len(at), "timed": len(timed), "agreement": p, "se": math.sqrt(p * (1 - p) / len(at)),
            "computed_share": mean([rows[i]["share"] for i in at]), "ttft_s": served, "full_ttft_s": full,
            "speedup": full / served}


def as_retrieved_speed(rows: Sequence[dict], reference_s: Sequence[float | None], start: int) -> dict | None:
    """`speed` of the settled requests (from `start`) whose every chunk was stored before (as retrieved)."""
    return speed(rows, reference_s, [i for i in range(start, len(rows)) if rows[i].get("as_retrieved", i % 2 == 1)])


def flagged(rows: Sequence[dict], start: int, flag: str) -> dict:
    """Requests whose row says `flag` (`near_tie`: served by full prefill after their blend;
    `blend_skipped`: served by exact reuse, the cost gate's), in the whole stream and from
    `start` (the settle) on."""
    at = [i for i, r in enumerate(rows) if r.get(flag)]
    return {"overall": len(at), "settled": sum(i >= start for i in at)}


def report(adaptive: dict, sweep: Sequence[dict], policy: str, reference_s: Sequence[float],
           target: float = TARGET) -> dict:
    a = adaptive_report(adaptive, policy)
    rows, start = adaptive["requests"], a["settled_from_request"]
    a["settled_speed"] = speed(rows, reference_s, range(start, len(rows)))
    a["settled_as_retrieved"] = as_retrieved_speed(rows, reference_s, start)
    a["near_ties"] = flagged(rows, start, "near_tie")
    a["blends_skipped"] = flagged(rows, start, "blend_skipped")
    timed = [x for x in reference_s if x is not None]
    full = {"policy": "full prefill (engine alone)", "requests": len(reference_s), "agreement": 1.0, "se": 0.0,
            "computed_share": 1.0, "ttft_s": mean(timed), "timed": len(timed)}
    s = sweep_report(sweep, a["settled"]["computed_share"], target)
    fixed = {ladder_budget(float(t["policy"].split("budget=")[1])): t for t in s["table"]
             if t["policy"].startswith(f"{policy}:budget=")}
    for h in a["honesty"]:  # the interval against the fixed run of the same budget, where swept
        t = fixed.get(h["budget"])
        if t is not None and "wilson_lower" in h:
            h.update(fixed_agreement=t["agreement"], fixed_requests=t["requests"],
                     covers_fixed=h["wilson_lower"] <= t["agreement"] <= h["wilson_upper"])
    s["table"].append(full)
    shorter = sorted({len(r["requests"]) for r in sweep if len(r["requests"]) < a["requests"]})
    for m in shorter:  # the adaptive run on the requests a shorter sweep served (the stream's first m)
        s["table"].append({**rate(adaptive["requests"][:m]), "policy": f"adaptive, first {m} requests"})
    return {"adaptive": a, "sweep": s}


def print_report(rep: dict, title: str) -> None:
    a, s = rep["adaptive"], rep["sweep"]
    pct = lambda x: "-" if x is None or x != x else f"{x:.1%}"  # noqa: E731
    print(f"\n== {title}")
    print("budget trajectory: " + ", ".join(f"#{t['request']}: {t['to']:.2f}" for t in a["trajectory"]))
    st = a["settled"]
    print(f"settled at {a['settled_budget']:.2f} from request {a['settled_from_request']}: {st['requests']} requests, "
          f"true agreement {st['agreement']:.3f} +- {st['se']:.3f}, computed {pct(st['computed_share'])}; "
          f"whole stream {a['overall']['agreement']:.3f}, computed {pct(a['overall']['computed_share'])}")
    c = a["sampling_cost"]
    print(f"sampled {a['sampled']} of {a['requests']} ({a['blended']} blended, {a['sampled_after_settle']} after the "
          f"settle, {c.get('shadow_blends', 0)} shadow blends); shadow row-layers {pct(c['row_share'])} of all; shadow {c['shadow_s']:.1f} s beside "
          f"{c['served_compute_s']:.1f} s served compute ({c['served_ttft_s']:.1f} s TTFT); TTFT sampled "
          f"{a['ttft_sampled_s'] * 1e3:.1f} ms, unsampled {a['ttft_unsampled_s'] * 1e3:.1f} ms "
          f"(blended {a['ttft_unsampled_blended_s'] * 1e3:.1f} ms)")
    print(f"{'budget':>7} {'reqs':>5} {'blended':>7} {'samples':>7} {'shadow blends':>13} {'Wilson 95%':>15} "
          f"{'true (all)':>10} {'covered':>7} {'true (blended)':>14} {'covered':>7}")
    for h in a["honesty"]:
        iv = f"[{h['wilson_lower']:.3f}, {h['wilson_upper']:.3f}]" if "wilson_lower" in h else "no samples"
        print(f"{h['budget']:>7.2f} {h['requests']:>5} {h['blended']:>7} {h.get('service_samples', 0):>7} "
              f"{h.get('service_shadow_blends', 0):>13} {iv:>15} {ratio(h['true_agreement_all']):>10} "
              f"{str(h.get('covers_all', '-')):>7} "
              f"{h['true_agreement_blended']:>14.3f} {str(h.get('covers_blended', '-')):>7}"
              + (f"   fixed run: {h['fixed_agreement']:.3f} covered {h['covers_fixed']}" if "covers_fixed" in h else ""))
    if a["overall"].get("answer_tokens"):
        print(answers_line(a, ANSWER_TOKENS))
    print(f"{'policy':<26} {'reqs':>5} {'agreement':>10} {'s.e.':>6} {'computed':>9} {'TTFT ms':>8} "
          f"{'answers (teacher forced)':>24}")
    for t in s["table"]:
        print(f"{t['policy']:<26} {t['requests']:>5} {t['agreement']:>10.3f} {t['se']:>6.3f} "
              f"{pct(t['computed_share']):>9} {t['ttft_s'] * 1e3:>8.1f} {ratio(t.get('answer_agreement')):>24}")
    b = s["smallest_budget_meeting_target"]
    if not fixed_runs(s["table"]):
        print("no fixed budget ran beside it (--sweep none)")
    elif b is None:
        print("no fixed budget of the sweep meets the target")
    else:
        print(f"smallest fixed budget with agreement >= target: {b:.2f} (computed {pct(s['its_computed_share'])}); "
              f"adaptive settled share / that: {s['settled_share_ratio']:.2f}x")
