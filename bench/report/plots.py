"""The results pages' plots, drawn from committed results (docs/results/) into docs/plots/:

    ttft-by-length.png        TTFT against prompt length, per policy (ttft-lengths.json)
    fidelity-by-budget.png    first-token agreement with full prefill against the recompute
                              budget, per model (the fidelity streams' fixed-budget runs; the
                              real model's fixed-budget results)
    hit-rate-by-capacity.png  hit rate against cache capacity, per eviction order (hit-rate.json)

`kvcraft bench report` draws them (matplotlib, the bench extra).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from kvbench import results
from kvbench.report.serving import lengths_series

PLOTS = results.ROOT / "docs" / "plots"
# (model label, results file) of the fixed-budget runs of the `query` policy per model
FIDELITY = (("4-layer model, short task", "fidelity-short-seed1.json"),
            ("4-layer model, long task", "fidelity-long-seed1.json"),
            ("SmolLM2-135M, MuSiQue", "fidelity-musique-300.json"))
SMOLLM2_FIXED = "musique-heldout-joined-100.json"  # its `query` (reads and deviation joined) at 15%
TARGET = 0.95


def _pyplot():  # noqa: ANN202 - the module
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:  # noqa: ANN001 - a Figure
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})  # no version in the file: it changes nothing drawn
    return path


def ttft_by_length(folder: Path, out: Path) -> Path:
    r = results.load(folder / "ttft-lengths.json")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    lengths = [run["shape"]["prompt_tokens"] for run in r["runs"]]
    for case, ms in lengths_series(r["runs"]).items():
        if "(gRPC)" in case:
            continue  # the same computation as over shared memory, plus the stream
        full = "full prefill" in case
        ax.plot(lengths, ms, marker="o", linestyle="--" if full else "-", linewidth=2 if full else 1.2,
                label=case.replace(" (shm)", ""))
    ax.set_xlabel("prompt tokens (chunks of %d tokens + a %d-token question)" % (
        r["runs"][0]["shape"]["chunk_len"], r["runs"][0]["shape"]["question_len"]))
    ax.set_ylabel(f"TTFT, ms (median of {r['repeats']})")
    ax.set_yscale("log")
    ax.set_title(f"TTFT against prompt length: {r['runs'][0]['shape']['layers']}-layer random Llama "
                 f"(hidden {r['runs'][0]['shape']['hidden']}), CPU", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, out / "ttft-by-length.png")


def _budget(policy: str) -> float | None:
    m = re.fullmatch(r"query:budget=([\d.]+)", policy)
    return float(m[1]) if m else None


def fidelity_by_budget(folder: Path, out: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, name in FIDELITY:
        table = results.load(folder / name)["report"]["sweep"]["table"]
        points = sorted((_budget(t["policy"]), t["agreement"], t["se"]) for t in table if _budget(t["policy"]))
        if label.startswith("SmolLM2"):
            joined = results.load(folder / SMOLLM2_FIXED)
            q = next(p for p in joined["policies"] if p["policy"] == "query:deviation=0.5")
            points = sorted(points + [(0.15, q["first_token_agrees"], None)])
        ax.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] or 0 for p in points],
                    marker="o", capsize=3, label=label)
    ax.axhline(TARGET, color="0.5", linestyle=":", label=f"the service's target ({TARGET})")
    ax.set_xlabel("recompute budget (share of the reused chunks' and the question's row-layers)")
    ax.set_ylabel("first token = full prefill's (share of requests)")
    ax.set_title("Fidelity against recompute budget, the default policy (query) at fixed budgets", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, out / "fidelity-by-budget.png")


def hit_rate_by_capacity(folder: Path, out: Path) -> Path:
    r = results.load(folder / "hit-rate.json")
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(r["traces"]), figsize=(5 * len(r["traces"]), 4.2), squeeze=False)
    for ax, t in zip(axes[0], r["traces"]):
        for order in dict.fromkeys(x["order"] for x in t["rows"]):
            pts = [(x["capacity_share"], x["hit_rate"]) for x in t["rows"] if x["order"] == order]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=order)
        ax.set_title(f"{t['preset']} trace ({t['requests']:,} requests)", fontsize=10)
        ax.set_xlabel("cache capacity (share of the distinct chunk tokens)")
        ax.set_ylabel("hit rate (retrieved chunk tokens found stored)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, out / "hit-rate-by-capacity.png")


DRAW: tuple[Callable[[Path, Path], Path], ...] = (ttft_by_length, fidelity_by_budget, hit_rate_by_capacity)


def draw_all(folder: Path = results.RESULTS, out: Path = PLOTS) -> list[Path]:
    return [draw(folder, out) for draw in DRAW]
