"""Run `kvcraft serve` as a child process on a free loopback port (demo, tests, benches)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO


# glibc raises its mmap threshold as big blocks are freed and then keeps freed layer
# buffers (MiBs each, a heap per worker thread): in-flight Stores would leave RSS behind.
# A fixed 1 MiB threshold returns them to the OS (docs/operations.md; deploy/ sets it too).
SERVER_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


class ServiceProcess:
    """The service exactly as operators run it: its own process, real RocksDB, real files."""

    def __init__(self, data_dir: Path, env: dict[str, str] | None = None, cwd: str | None = None,
                 **settings: object) -> None:
        self.data_dir = Path(data_dir)
        self.env = env or {}
        self.cwd = cwd  # where `python -m kvservice.cli` runs (bench/load.py: another checkout)
        self.settings = {"host": "127.0.0.1", "port": 0, "data_dir": str(self.data_dir), **settings}
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}-server.log"
        self._log: IO[bytes] | None = None

    def start(self, timeout: float = 60.0) -> "ServiceProcess":
        cfg = self.data_dir.parent / f"{self.data_dir.name}.toml"
        cfg.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in self.settings.items()))
        if self._log is None:
            self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvservice.cli", "serve", "--config", str(cfg)],
            stdout=subprocess.PIPE, stderr=self._log, text=True, env={**os.environ, **SERVER_ENV, **self.env},
            cwd=self.cwd,
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"kvcraft serve exited with {self.proc.wait()}: {self.log()[-2000:]}")
            if line.startswith("kvcraft serving on "):
                self.address = line.split()[3]
                return self
        raise RuntimeError(f"kvcraft serve did not start within {timeout:.0f}s")

    def kill(self) -> None:
        """SIGKILL: no cleanup, as in a crash."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> int:
        """SIGTERM: graceful drain; returns the exit code."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            return self.proc.wait(timeout=30)
        return self.proc.returncode if self.proc else 0

    def restart(self) -> "ServiceProcess":
        self.stop()
        return self.start()

    def close(self) -> None:
        self.kill()
        if self._log is not None:
            self._log.close()
            self._log = None

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def __enter__(self) -> "ServiceProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.close()


def _toml(v: object) -> str:
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v)
