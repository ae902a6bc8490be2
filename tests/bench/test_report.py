"""The results pages are what their committed results render (kvbench.report): a table edited by
hand, a results file changed without rendering again, or a results file no page names fails here."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from kvbench import results
from kvbench.report import VIEWS, page, plots

DOCS = results.ROOT / "docs"
RESULTS_PAGES = {"benchmarks.md": 350, "quality.md": 400}


def test_every_committed_page_is_what_its_results_render():
    assert page.stale(VIEWS) == [], "run `kvcraft bench report` and commit the pages"


def test_every_results_file_is_named_by_a_page():
    assert page.unreferenced() == []


@pytest.fixture
def docs_copy(tmp_path) -> Path:
    """docs/ (pages and results) and the README, copied: a checkout to edit."""
    shutil.copytree(DOCS, tmp_path / "docs", ignore=shutil.ignore_patterns("*.png"))
    shutil.copy(results.ROOT / "README.md", tmp_path / "README.md")
    return tmp_path / "docs"


def _first_block(text: str) -> re.Match:
    return next(m for m in page.BLOCK.finditer(text) if re.search(r"\d", m["body"]))


def test_a_number_edited_by_hand_in_a_table_is_caught(docs_copy):
    md = docs_copy / "benchmarks.md"
    text = md.read_text()
    m = _first_block(text)
    body = m["body"]
    i = re.search(r"\d", body).start()
    edited = body[:i] + str((int(body[i]) + 1) % 10) + body[i + 1:]
    md.write_text(text[:m.start("body")] + edited + text[m.end("body"):])
    folder = docs_copy / "results"
    assert page.stale(VIEWS, docs_copy, folder) == [md]
    md.write_text(page.render(md.read_text(), VIEWS, folder))  # `kvcraft bench report` puts it back
    assert page.stale(VIEWS, docs_copy, folder) == [] and md.read_text() == text


def test_a_results_file_changed_without_rendering_again_is_caught(docs_copy):
    folder = docs_copy / "results"
    f = folder / "hit-rate.json"
    r = json.loads(f.read_text())
    r["traces"][0]["rows"][0]["hit_rate"] += 0.1
    f.write_text(json.dumps(r))
    assert page.stale(VIEWS, docs_copy, folder) == [docs_copy / "benchmarks.md"]


def test_a_results_file_no_page_names_is_caught(docs_copy):
    folder = docs_copy / "results"
    shutil.copy(folder / "crash.json", folder / "crash-again.json")
    assert page.unreferenced(docs_copy, folder) == ["crash-again.json"]


def test_a_block_naming_a_missing_file_is_refused(docs_copy):
    with pytest.raises(FileNotFoundError, match="no-such.json"):
        page.render("<!-- results crash no-such.json -->\n<!-- end results -->\n", VIEWS, docs_copy / "results")


def test_the_plots_draw_from_the_committed_results_and_the_pages_show_them(tmp_path):
    drawn = plots.draw_all(out=tmp_path)
    assert [p.name for p in drawn] == ["ttft-by-length.png", "fidelity-by-budget.png", "hit-rate-by-capacity.png"]
    for p in drawn:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
    shown = {name for p in page.pages() for name in re.findall(r"\]\(plots/([\w.-]+\.png)\)", p.read_text())}
    assert shown == {p.name for p in drawn} and all((DOCS / "plots" / name).is_file() for name in shown)


@pytest.mark.parametrize("name,limit", sorted(RESULTS_PAGES.items()))
def test_results_pages_stay_results_pages(name, limit):
    """Short, and no history in their prose: no commit hashes, no clock times (git keeps those)."""
    text = (DOCS / name).read_text()
    assert len(text.splitlines()) < limit
    prose = page.BLOCK.sub("", text)
    assert not re.findall(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", prose)
    assert not re.findall(r"\b\d\d:\d\d(?::\d\d)? ?UTC\b", prose)
