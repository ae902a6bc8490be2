"""A results page's tables, between marker comments, rendered from the committed results.

    <!-- results VIEW FILE.json [FILE.json ...] -->
    (what `VIEW` renders from docs/results/FILE.json ..., with a "Run:" line per file)
    <!-- end results -->

`kvcraft bench report` rewrites every block of every page under docs/ (`render`); the test
suite renders them again and fails where a committed page differs (`stale`). Text outside
the blocks is the page's own: method and interpretation.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from kvbench import results

BLOCK = re.compile(r"(<!-- results (?P<view>[\w:-]+)(?P<files>(?: [\w.-]+\.json)+) -->\n)(?P<body>.*?)"
                   r"(<!-- end results -->)", re.S)
JSON_NAME = re.compile(r"[\w.-]+\.json")

View = Callable[[list[tuple[str, dict]]], str]  # [(file name, result)] -> markdown


def render(text: str, views: dict[str, View], folder: Path = results.RESULTS) -> str:
    """`text` with every block rendered from `folder`; KeyError for an unknown view or file."""
    def one(m: re.Match) -> str:
        view = m["view"]
        if view not in views:
            raise KeyError(f"no results view {view!r} (kvbench.report.views)")
        missing = [f for f in m["files"].split() if not (folder / f).is_file()]
        if missing:
            raise FileNotFoundError(f"results block {view!r} names {', '.join(missing)}: not in {folder}")
        named = [(f, results.load(folder / f)) for f in m["files"].split()]
        return m.group(1) + views[view](named).rstrip("\n") + "\n" + m.group(5)
    return BLOCK.sub(one, text)


def blocks(text: str) -> list[tuple[str, list[str]]]:
    """(view, files) of each block of a page."""
    return [(m["view"], m["files"].split()) for m in BLOCK.finditer(text)]


def referenced(text: str) -> set[str]:
    """The results files a page names: in its blocks, links or prose."""
    return set(JSON_NAME.findall(text))


def pages(docs: Path = results.ROOT / "docs") -> list[Path]:
    return sorted(docs.glob("*.md"))


def stale(views: dict[str, View], docs: Path = results.ROOT / "docs", folder: Path = results.RESULTS) -> list[Path]:
    """The pages whose committed blocks differ from what their results render."""
    return [p for p in pages(docs) if render(p.read_text(), views, folder) != p.read_text()]


def unreferenced(docs: Path = results.ROOT / "docs", folder: Path = results.RESULTS) -> list[str]:
    """Results files in `folder` that no page under `docs` (nor the README) names."""
    named = set().union(*(referenced(p.read_text()) for p in pages(docs)),
                        referenced((docs.parent / "README.md").read_text()))
    return sorted(p.name for p in folder.glob("*.json") if p.name not in named)
