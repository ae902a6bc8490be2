"""`kvcraft model fetch` run as users run it: a child process of the installed command."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FetchRun:
    path: Path
    stdout: str
    stderr: str


def run_fetch(folder: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvcli.main", "model", "fetch", "--dir", str(folder)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def fetch(folder: Path) -> FetchRun:
    """Fetch into `folder` (a no-op when it holds the model already); fails the test if the
    command does."""
    done = run_fetch(folder)
    assert done.returncode == 0, done.stderr
    return FetchRun(folder, done.stdout, done.stderr)
