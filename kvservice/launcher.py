"""Run `kvcraft serve` as a child process on a free loopback port (demo, tests, benches),
and `ChildProcess`, the start/wait/stop of such helper processes (also mooncake_master)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Sequence

from kvservice.config import STARTER_PID_ENV
from kvservice.segments import remove_stale_segments


# glibc: layer-sized buffers (up to 32 MiB) come from the heap and up to 64 MiB of free
# heap top is kept, so streams reuse memory instead of an mmap + page faults + munmap per
# message; one arena, so that the server's malloc_trim once idle reaches every freed
# page (kvservice/server/heap.py, docs/operations.md; deploy/ sets the same).
SERVER_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 20), "MALLOC_ARENA_MAX": "1"}
# A killed test or benchmark leaves no service holding its data dir (config exit_with_parent;
# an env var, which a checkout older than the setting ignores: bench/service/load.py runs one).
CHILD_ENV = {"KVCRAFT_EXIT_WITH_PARENT": "true"}


class ChildProcess:
    """A helper process of ours (the service, a mooncake_master): started and waited
    for until it is ready, its output appended to a log file, stopped or killed."""

    what = "process"  # in errors

    def __init__(self, log_path: Path, prefix: Sequence[str] = ()) -> None:
        self.log_path = Path(log_path)
        self.prefix = list(prefix)  # argv before the command: e.g. `ip netns exec <ns>` (kvbench.common.netns)
        self.proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    def _launch(self, argv: list[str], ready: Callable[[], bool], timeout: float, **popen: Any) -> None:
        """Start `argv` (its stderr to the log unless `popen` says otherwise) and call
        `ready()` until it is true; a child that exits first or a timeout raise."""
        self.proc = subprocess.Popen(self.prefix + argv, **{"stderr": self._log_file(), **popen})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.what} exited with {self.proc.wait()}: {self.log()[-2000:]}")
        raise RuntimeError(f"{self.what} did not start within {timeout:.0f}s")

    def _log_file(self) -> IO[bytes]:
        if self._log is None:
            self._log = open(self.log_path, "ab")
        return self._log

    def start(self, timeout: float = 60.0) -> "ChildProcess":
        raise NotImplementedError

    def kill(self) -> None:
        """SIGKILL: no cleanup, as in a crash."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> int:
        """Stop it (SIGKILL unless a subclass drains); returns the exit code."""
        self.kill()
        return self.proc.returncode if self.proc else 0

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """SIGSTOP for the block, SIGCONT after it (also when the block raises): a gray
        failure, the process alive with its sockets open and answering nothing (a stalled
        host, a long pause). `ip netns exec` execs its command: the signal reaches it."""
        assert self.proc is not None and self.proc.poll() is None, f"{self.what} is not running"
        self.proc.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> "ChildProcess":
        self.stop()
        return self.start()

    def close(self) -> None:
        self.kill()
        if self._log is not None:
            self._log.close()
            self._log = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> "ChildProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.close()


class ServiceProcess(ChildProcess):
    """The service exactly as operators run it: its own process, real RocksDB, real files."""

    what = "kvcraft serve"

    def __init__(self, data_dir: Path, env: dict[str, str] | None = None, cwd: str | None = None,
                 prefix: Sequence[str] = (), **settings: object) -> None:
        self.data_dir = Path(data_dir)
        super().__init__(self.data_dir.parent / f"{self.data_dir.name}-server.log", prefix)
        self.env = env or {}
        self.cwd = cwd  # where `python -m kvservice.cli` runs (bench/service/load.py: another checkout)
        self.settings = {"host": "127.0.0.1", "port": 0, "data_dir": str(self.data_dir), **settings}
        self.address = ""

    def start(self, timeout: float = 60.0) -> "ServiceProcess":
        cfg = self.data_dir.parent / f"{self.data_dir.name}.toml"
        cfg.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in self.settings.items()))

        def ready() -> bool:  # the one line `serve` prints once it listens (blocks until a line)
            assert self.proc is not None and self.proc.stdout is not None
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()  # output closed: it exited
            elif line.startswith("kvcraft serving on "):
                self.address = line.split()[3]
                return True
            return False

        env = {**os.environ, **SERVER_ENV, **CHILD_ENV, STARTER_PID_ENV: str(os.getpid()), **self.env}
        self._launch([sys.executable, "-m", "kvservice.cli", "serve", "--config", str(cfg)], ready, timeout,
                     stdout=subprocess.PIPE, text=True, env=env, cwd=self.cwd)
        return self

    def stop(self) -> int:
        """SIGTERM: graceful drain; returns the exit code."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            return self.proc.wait(timeout=30)
        return self.proc.returncode if self.proc else 0

    def close(self) -> None:
        """Kill it if still running, and unlink the host slab a killed instance leaves in
        /dev/shm (a start does that too, but a data dir nobody starts again would keep it).
        Only after an instance of this object served: one refused the data dir (another
        service holds it) must not unlink the holder's slab."""
        super().close()
        if self.address:
            remove_stale_segments(self.data_dir)

    def restart(self, crash: bool = False) -> "ServiceProcess":
        """Stop (SIGTERM; SIGKILL when `crash`) and start again on the same address, as an
        operator's restart does: live clients reconnect to it."""
        if self.address:
            self.settings["port"] = int(self.address.rsplit(":", 1)[1])
        if crash:
            self.kill()
        else:
            self.stop()
        return self.start()


def _toml(v: object) -> str:
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v)
