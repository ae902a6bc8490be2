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
