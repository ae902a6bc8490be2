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
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


class ServerProcess:
    """`kvcraft serve` as users run it: a separate process, real RocksDB, real files."""

    def __init__(self, data_dir: Path, **settings: object) -> None:
        self.data_dir = data_dir
        self.settings = {"host": "127.0.0.1", "port": 0, "data_dir": str(data_dir), **settings}
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.log_path = data_dir.parent / f"{data_dir.name}-server.log"

    def start(self) -> "ServerProcess":
        cfg = self.data_dir.parent / f"{self.data_dir.name}.toml"
        cfg.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in self.settings.items()))
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvservice.cli", "serve", "--config", str(cfg)],
            stdout=subprocess.PIPE, stderr=self._log, text=True,
        )
        deadline = time.monotonic() + 60
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"server exited ({self.proc.wait()}): {self.log_path.read_text()[-2000:]}")
            if line.startswith("kvcraft serving on "):
                self.address = line.split()[3]
                self.ready_line = line
                return self
        raise RuntimeError("server did not start within 60 s")

    def kill(self) -> None:
        """SIGKILL: no cleanup, like a crash."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> int:
        """SIGTERM: graceful drain. Returns the exit code."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            return self.proc.wait(timeout=30)
        return self.proc.returncode if self.proc else 0

    def restart(self) -> "ServerProcess":
        self.stop()
        return self.start()

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


def _toml(v: object) -> str:
    if isinstance(v, str):
        return '"' + v + '"'
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v)


@pytest.fixture
def start_server(tmp_path):
    """Factory: start_server(**settings) -> a running ServerProcess; all stopped after."""
    started: list[ServerProcess] = []

    def start(name: str = "data", **settings: object) -> ServerProcess:
        s = ServerProcess(tmp_path / name, **settings).start()
        started.append(s)
        return s

    yield start
    for s in started:
        s.kill()


@pytest.fixture
def kvserver(start_server):
    return start_server()
