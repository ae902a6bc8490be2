"""The README's two set-up commands are what CI and users run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())[:2]


def test_readme_starts_with_demo_and_test_commands():
    demo, suite = readme_commands()
    assert demo.endswith("kvcraft demo")
    assert suite.endswith("python -m pytest")


def test_ci_runs_readme_test_command_verbatim():
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci_lines


def test_no_file_points_at_design_notes_users_do_not_have():
    """The team's design notes (DESIGN.md, ENV.md, STYLE.md beside the repository) are not
    shipped: code and docs state the fact or name the project's own docs instead."""
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    pattern = re.compile(r"\.\./shared/|\b(?:DESIGN|ENV|STYLE)\.md\b")
    hits = [f"{f}:{n}" for f in files if f.endswith((".py", ".md", ".toml", ".txt", ".cfg", ".yaml", ".yml"))
            and f != "tests/test_readme.py"
            for n, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1) if pattern.search(line)]
    assert not hits, hits
