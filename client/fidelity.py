"""Admin Stats' sampled fidelity and the fidelity controller's budgets as text tables
(`kvcraft admin fidelity`, the demo; docs/quality.md, "Fidelity on live traffic"), and as
plain data for benchmarks' JSON."""

from __future__ import annotations

from kvcraft.v1 import kvcraft_pb2 as pb


def fidelity_table(stats: pb.StatsResponse, model_id: str | None = None) -> str:
    """`kvcraft admin fidelity`: the service's fidelity target, the controller's budget per
    (model, policy) of adaptive engines, then one line per (model, policy, budget) of the
    samples; `model_id`: that model's lines only."""
    target = (f"fidelity target: first-token agreement >= {stats.fidelity_target:.3f}\n" if stats.fidelity_target
              else "fidelity target: none (fidelity_target = 0): engines spend budgets of their own\n")
    out = target + _table(("model", "policy", "budget", "state", "measuring below", "near ties under"),
                          [(c.model_id, c.policy, f"{c.budget:.2f}", c.state, f"{c.below:.2f}" if c.below else "-",
                            f"{c.near_tie:.2f}" if c.near_tie else "-")
                           for c in stats.budgets if model_id in (None, c.model_id)])
    fidelity = [r for r in stats.fidelity if model_id in (None, r.model_id)]
    if not fidelity:
        return out + "no fidelity samples yet (engines send them with their Plans; docs/quality.md)\n"
    rows = []
    for r in fidelity:
        rate = r.top1_agree / r.samples if r.samples else 0.0
        answer = f"{r.answer_agree / r.answer_tokens:.3f} of {r.answer_tokens}" if r.answer_tokens else "-"
        rows.append((r.model_id, r.policy, f"{r.budget:.2f}" if r.budget else "-", str(r.samples),
                     str(r.shadow_blends), str(r.top1_agree), f"{rate:.3f}", f"[{r.agree_lower:.3f}, {r.agree_upper:.3f}]",
                     f"{r.mean_kl:.4g}", f"{r.mean_computed_share:.3f}", answer))
    head = ("model", "policy", "budget", "samples", "shadow_blends", "top1_agree", "agreement", "95% interval",
            "mean_kl", "computed", "answer_agree")
    return out + _table(head, rows)


def fidelity_record(stats: pb.StatsResponse) -> dict:
    """Admin Stats' fidelity as plain data (benchmarks keep it in their JSON): the target, the
    controller's budget per (policy) of adaptive engines, the samples per (policy, budget);
    budgets rounded to 4 places (they travel as float32)."""
    return {"fidelity_target": stats.fidelity_target,
            "fidelity": [{"policy": f.policy, "budget": round(f.budget, 4), "samples": f.samples,
                          "top1_agree": f.top1_agree, "agree_lower": f.agree_lower, "agree_upper": f.agree_upper,
                          "mean_kl": f.mean_kl, "mean_computed_share": f.mean_computed_share,
                          "answer_tokens": f.answer_tokens, "answer_agree": f.answer_agree,
                          "shadow_blends": f.shadow_blends} for f in stats.fidelity],
            "budgets": [{"policy": b.policy, "budget": round(b.budget, 4), "state": b.state, "below": round(b.below, 4),
                         "near_tie": round(b.near_tie, 4)}
                        for b in stats.budgets]}


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Columns padded to their widest cell; nothing when there are no rows."""
    if not rows:
        return ""
    lines = [head, *rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() + "\n" for line in lines)
