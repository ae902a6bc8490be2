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
