"""Results views of answer quality (kvbench.quality): the synthetic tasks as deployed, token
selection in process, the service's evaluation, naive reuse by transformers, and the real model
on MuSiQue (also what `kvcraft bench real-quality` and `real-bound` print: `musique_table`)."""

from __future__ import annotations

import re
import statistics

from kvbench.report.markdown import num, pct, sources, table

Named = list[tuple[str, dict]]


def deployed(named: Named) -> str:
    """One row per policy, a column group per task (its results file)."""
    tasks = [(r["task"], {x["policy"]: x for x in r["rows"]}) for _, r in named]
    policies = list(dict.fromkeys(p for _, rows in tasks for p in rows))
    head = ["policy"]
    for task, _ in tasks:
        head += [f"{task}: accuracy", "of full", "agree with full", "computed: all, as retrieved"]
    rows = []
    for p in policies:
        cells = [p]
        for _, by in tasks:
            x = by.get(p)
            cells += ([pct(x["accuracy"]), pct(x["of_full"]), pct(x["agreement_with_full"]),
                       f"{pct(x['computed_share'])}, {pct(x['computed_share_as_retrieved'])}"] if x else [""] * 4)
        rows.append(cells)
    full = "; ".join(f"{task} {pct(next(iter(by.values()))['full_accuracy'])}" for task, by in tasks)
    sizes = "; ".join(f"{r['task']} {r['examples']} examples, held-out draw {r['seed']}" for _, r in named)
    return table(head, rows) + f"\n\nFull prefill's accuracy: {full} ({sizes}).\n\n{sources(named)}"


# The selections `kvcraft bench selection` measures (kvbench.quality.selection.methods), in order.
SELECTIONS = ("full prefill", "naive reuse", "cacheblend r=15%", "cacheblend r=30%",
              "cachecraft top 15% by inter-attention (eq. 14)", "learned: fresh gain, prompt budget 15%",
              "learned: default (greedy recompute gain, 4 rounds), prompt budget 15%")


def selection(named: Named) -> str:
    """Exact match and prompt token-layers computed per selection; a column pair per (task,
    held-out draw), its rows from the first file of that pair that has them."""
    groups: dict[tuple[str, int], dict[str, dict]] = {}
    for _, r in named:
        rows = groups.setdefault((r.get("task", "short"), r["seed"]), {})
        for x in r["rows"]:
            rows.setdefault(x["selection"], x)
    head = ["selection"]
    for task, seed in groups:
        head += [f"{task}, draw {seed}: exact match", "computed"]
    body = []
    for name in SELECTIONS:
        cells = [name]
        for rows in groups.values():
            x = rows.get(name)
            cells += [pct(x["acc_all"]), pct(x["prompt_computed"])] if x else ["", ""]
        body.append(cells)
    return table(head, body) + f"\n\n{sources(named)}"


def evaluate(named: Named) -> str:
    rows = [[x["setting"], pct(x["accuracy"]), pct(x["computed_share"]), pct(x["recomputed_share_of_reused"]),
             num(x["first_token_logit_dev_mean"], 3), f"`{name}`"] for name, r in named for x in r["rows"]]
    return table(["setting (through the service)", "accuracy", "prompt token-layers computed",
                  "reused tokens recomputed", "first-token logit deviation", "results"], rows) + f"\n\n{sources(named)}"


def naive_check(named: Named) -> str:
    rows = []
    for _, r in named:
        for way in ("full", "naive"):
            kinds = ", ".join(f"{k} {pct(v)}" for k, v in r[way].items() if k != "all")
            rows.append([r["task"], r["n"], way, pct(r[way]["all"]), kinds])
    return table(["task", "held-out prompts", "prefill", "exact match", "by question kind"], rows) + \
        f"\n\n{sources(named)}"


# What a MuSiQue row shows, in order: (JSON key, column, format); a column only where a row has it.
MUSIQUE = (("rouge_l_vs_full", "ROUGE-L vs full", lambda x: f"{x:.3f}"), ("rouge_l_se", "s.e.", lambda x: f"{x:.3f}"),
           ("identical_to_full", "identical to full", lambda x: f"{x:.0%}"),
           ("first_token_agrees", "first token = full", lambda x: f"{x:.0%}"),
           ("first_token_se", "s.e.", lambda x: f"{x:.0%}"),
           ("answer_forced_agrees", "answer, teacher forced", lambda x: f"{x:.0%}"), ("records", "records (n)", str),
           ("f1", "F1", lambda x: f"{x:.3f}"),
           ("exact_match", "EM", lambda x: f"{x:.1%}"), ("computed_share", "row-layers computed", lambda x: f"{x:.1%}"),
           ("ttft_s", "mean TTFT (s)", lambda x: f"{x:.2f}"),
           ("speedup_vs_transformers", "speed-up vs transformers", lambda x: f"{x:.2f}x"))
PAIRED = re.compile(r"^rouge_l_vs_(?!full$)(\w+?)$")


def musique_table(result: dict) -> str:
    """A real-model result (`policies` of real-quality, `cases` of real-bound) as a table; a paired
    difference column per `rouge_l_vs_X` (+ `_se`) the rows carry; records' prompt size under it."""
    rows = result.get("policies") or result["cases"]
    label = "policy" if "policies" in result else "case"
    cols = [c for c in MUSIQUE if any(c[0] in r for r in rows)]
    paired = list(dict.fromkeys(m[1] for r in rows for k in r if (m := PAIRED.match(k)) and not k.endswith("_se")))
    at = 2 if any(c[0] == "rouge_l_se" for c in cols) else 1
    head = [label] + [c[1] for c in cols[:at]] + [f"vs {p.replace('_', ' ')}, paired (s.e.)" for p in paired] + \
        [c[1] for c in cols[at:]]
    body = []
    for r in rows:
        cells = [r[label]] + [f(r[k]) if k in r else "" for k, _, f in cols[:at]]
        cells += [f"{r[f'rouge_l_vs_{p}']:+.3f} ({r[f'rouge_l_vs_{p}_se']:.3f})" if f"rouge_l_vs_{p}" in r else ""
                  for p in paired]
        cells += [f(r[k]) if k in r else "" for k, _, f in cols[at:]]
        body.append(cells)
    out = table(head, body)
    recs = result.get("records", [])
    if recs and "prompt_tokens" in recs[0]:
        out += (f"\n\n{len(recs)} records, {statistics.fmean(r['prompt_tokens'] for r in recs):,.0f} prompt tokens on "
                f"average; transformers' SDPA full prefill: {statistics.fmean(r['transformers_prefill_s'] for r in recs):.2f}"
                " s on average.")
    return out


def musique(named: Named) -> str:
    return "\n\n".join(musique_table(r) for _, r in named) + f"\n\n{sources(named)}"


ORACLE_SELECTIONS = ("deviation", "reads", "free question pass", "greedy")
BUDGET_CASE = re.compile(r"^(?P<selection>.+) (?P<budget>\d+)%$")
PASSAGES = re.compile(r"--passages (\d+)")


def _agreement(row: dict) -> str:
    """First-token agreement (its standard error), ROUGE-L of the 16-token answers vs full
    prefill's, and the share of full prefill's answer predicted under teacher forcing."""
    forced = f" · {row['answer_forced_agrees']:.0%}" if "answer_forced_agrees" in row else ""
    return f"{row['first_token_agrees']:.0%} ({row['first_token_se']:.0%}) · {row['rouge_l_vs_full']:.2f}{forced}"


def oracle(named: Named) -> str:
    """`kvcraft bench real-bound --greedy` runs as one table: a row per (passages, budget), a
    column per selection; under it, naive reuse and the default of each run."""
    head = ["passages (records: ids)", "budget", *ORACLE_SELECTIONS[:-1], "greedy search (the oracle)",
            "greedy's computed"]
    body, fixed = [], []
    for _, r in named:
        passages = int(m[1]) if (m := PASSAGES.search(r["command"])) else 1
        ids = _ids(r["records"])
        group = f"{passages} ({r['meta']['records']}{f': {ids}' if ids else ''})"
        cases = {c["case"]: c for c in r["cases"]}
        budgets = list(dict.fromkeys(int(m["budget"]) for c in cases if (m := BUDGET_CASE.match(c))))
        for b in budgets:
            cells = [_agreement(cases[f"{s} {b}%"]) if f"{s} {b}%" in cases else "" for s in ORACLE_SELECTIONS]
            greedy = cases.get(f"greedy {b}%")
            body.append([group, f"{b}%", *cells, pct(greedy["computed_share"]) if greedy else ""])
        default = next(c for name, c in cases.items() if name.endswith(" (default)"))
        where = f"{passages} passages{f', records {ids}' if ids else ''}"
        fixed.append(f"{where}: naive reuse {_agreement(cases['naive'])} at "
                     f"{pct(cases['naive']['computed_share'])} computed, the default {_agreement(default)} at "
                     f"{pct(default['computed_share'])}")
    return (table(head, body) + "\n\nEach cell: first token = full prefill's (standard error) · ROUGE-L of the "
            "16-token answer against full prefill's · where measured, full prefill's 16-token answer under teacher "
            "forcing: the share of its tokens the case predicts, fed the ones before. " + "; ".join(fixed) + ". " +
            _where_picked(named) +
            f"\n\n{sources(named)}")


def _ids(records: list[dict]) -> str:
    """The records' ids (indices in the MuSiQue file) as a range where they run on, else listed;
    "" where the results lack them."""
    ids = [rec["id"] for rec in records if "id" in rec]
    if not ids:
        return ""
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])
    return ", ".join(map(str, ids))


def ape(named: Named) -> str:
    """`kvcraft bench real-bound --ape` runs as one table: a row per case but full prefill, a
    column per run (passages, records); each cell as the oracle table's, then its share computed
    (the page says so)."""
    runs = [(int(m[1]) if (m := PASSAGES.search(r["command"])) else 1, r) for _, r in named]
    cases = list(dict.fromkeys(c["case"] for _, r in runs for c in r["cases"] if c["case"] != "full"))
    head = ["case", *(f"{p} passages ({r['meta']['records']})" for p, r in runs)]
    body = []
    for case in cases:
        rows = [next((c for c in r["cases"] if c["case"] == case), None) for _, r in runs]
        body.append([case, *(f"{_agreement(c)} at {pct(c['computed_share'])}" if c else "" for c in rows)])
    return table(head, body) + f"\n\n{sources(named)}"


MARGINS = (0.5, 1.0, 2.0)  # logits: the gates `margin_gate` tries


def gated(records: list[dict], case: str, margin: float) -> tuple[float, float, float]:
    """`case` with a gate on its own first token: a record whose top next-token logit leads the
    runner-up's by less than `margin` is computed again in full (its first token full prefill's).
    (First-token agreement, share of records recomputed, row-layers computed per record: the
    case's, plus all of them where recomputed.)"""
    served = [r["served"][case] for r in records]
    again = [s["margin"] < margin for s in served]
    agree = [1.0 if a else s["first_token_agrees"] for s, a in zip(served, again)]
    computed = [s["computed_share"] + a for s, a in zip(served, again)]
    return statistics.fmean(agree), statistics.fmean(again), statistics.fmean(computed)


def margin_gate(named: Named) -> str:
    """`kvcraft bench real-bound` runs with margins: each case reusing KV, ungated and
    under each gate of `MARGINS`; under it, full prefill's margins where a case kept its first
    token and where one lost it."""
    body, notes = [], []
    for _, r in named:
        recs = [rec for rec in r["records"] if "margin" in rec["served"]["full"]]
        cases = [c for c in recs[0]["served"] if not c.startswith("full")] if recs else []  # reuse alone
        for case in cases:
            cells = [f"{pct(a, 0)} · {pct(s)}" for a, _, s in [gated(recs, case, 0.0)]]
            cells += [f"{pct(a, 0)} · {pct(g, 0)} · {pct(s)}" for a, g, s in (gated(recs, case, m) for m in MARGINS)]
            body.append([f"{case} ({len(recs)}: {_ids(recs)})", *cells])
        lost = [rec["served"]["full"]["margin"] for rec in recs
                if any(not v["first_token_agrees"] for v in rec["served"].values())]
        kept = [rec["served"]["full"]["margin"] for rec in recs
                if all(v["first_token_agrees"] for v in rec["served"].values())]
        if lost and kept:
            notes.append(f"Records {_ids(recs)}: full prefill's margin {statistics.median(kept):.2f} (median) where "
                         f"every case kept the first token ({len(kept)} records), {statistics.median(lost):.2f} "
                         f"where one lost it ({len(lost)}; largest {max(lost):.2f})")
    head = ["case (records)", "ungated: first token = full · computed",
            *(f"margin < {m:g}: first token = full · recomputed · computed" for m in MARGINS)]
    said = ["Margin: the logit of the case's first token over the runner-up's", *notes]
    return f"{table(head, body)}\n\n{'. '.join(said)}.\n\n{sources(named)}"


def _where_picked(named: Named, edge: int = 64) -> str:
    """Where the greedy search's rows lie in their passages at its largest budget: the share in a
    passage's first `edge` rows, its last `edge`, and between (against those regions' share of
    the passages' rows, what picks spread evenly would give)."""
    picked = {"first": 0, "last": 0, "between": 0}
    rows_in = dict(picked)
    for _, r in named:
        for rec in r["records"]:
            greedy = [v for k, v in rec["served"].items() if k.startswith("greedy ") and "rows" in v]
            if not greedy:
                continue
            top = max(greedy, key=lambda v: v["computed_share"])
            edges, rows = top["edges"], set(top["rows"])
            for a, b in zip(edges[1:-2], edges[2:-1]):  # the passages (between instruction and question)
                for row in range(a, b):
                    where = "first" if row - a < edge else "last" if b - row <= edge else "between"
                    rows_in[where] += 1
                    picked[where] += row in rows
    total, total_in = sum(picked.values()), sum(rows_in.values())
    if not total:
        return ""
    return ("Of the greedy search's rows at its largest budget, in the passages: " + ", ".join(
        f"{picked[w] / total:.0%} {'elsewhere' if w == 'between' else f'in its {w} {edge} rows'} "
        f"({rows_in[w] / total_in:.0%} of the rows)" for w in picked) + ".")


VIEWS = {"deployed": deployed, "selection": selection, "evaluate": evaluate, "naive-check": naive_check,
         "musique": musique, "oracle": oracle, "ape": ape, "margin-gate": margin_gate}
