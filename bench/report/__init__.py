"""`kvcraft bench report`: the results pages' tables and plots, rendered from the committed
results (docs/results/, kvbench.results).

    kvcraft bench report            # rewrite every results block under docs/ and draw the plots
    kvcraft bench report --check    # change nothing; exit 1 naming the pages whose blocks differ
                                    # and the results files no page names

A page marks each table it shows (kvbench.report.page); the views that render them:
`service` (the service benchmarks), `serving` (TTFT, vLLM), `quality` (answer quality, the
real model), `streams` (the fidelity streams); `plots` draws the figures.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from kvbench.report import page, quality, service, serving, streams, summary

VIEWS: dict[str, page.View] = {**service.VIEWS, **serving.VIEWS, **quality.VIEWS, **streams.VIEWS, **summary.VIEWS}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    ap = argparse.ArgumentParser(prog="kvcraft bench report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing: report what differs (exit 1)")
    ap.add_argument("--no-plots", action="store_true", help="the tables only")
    a = ap.parse_args(argv)
    loose = page.unreferenced()
    if a.check:
        stale = page.stale(VIEWS)
        for p in stale:
            print(f"{p}: its tables differ from what its results render (kvcraft bench report)")
        for name in loose:
            print(f"docs/results/{name}: no page names it")
        return 1 if stale or loose else 0
    for p in page.pages():
        text = p.read_text()
        new = page.render(text, VIEWS)
        if new != text:
            p.write_text(new)
            print(f"rendered {p}")
    if not a.no_plots:
        from kvbench.report import plots

        for path in plots.draw_all():
            print(f"drew {path}")
    for name in loose:
        print(f"warning: docs/results/{name} is named by no page", file=sys.stderr)
    return 0
