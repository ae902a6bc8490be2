"""An HTTP server process on a free loopback port, waited for until it answers: vLLM's OpenAI
server and the example RAG server, as the vLLM tests start them."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from typing import Callable

from kvbench.common.engines import own_temp_dir

# how a server says its port was taken, lower-cased: "[Errno 98] Address already in use" (vLLM's
# OpenAI server), "... error while attempting to bind on address (...): address already in use" (uvicorn)
PORT_TAKEN = "address already in use"
ATTEMPTS = 3  # ports tried: one is free when chosen, and another process may bind it before the server does


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2).close()
        return True
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def serve(argv: Callable[[int], list[str]], env: dict, log_path: Path, ready: str = "/health",
          timeout_s: float = 600) -> tuple[subprocess.Popen, str]:
    """Start `argv(port)` with its output in `log_path` and wait until `ready` answers; returns
    the process and its base URL. A server that exits because its port was taken in the
    meantime (`PORT_TAKEN` in its log) starts again on another; any other exit, or no answer
    within `timeout_s`, raises AssertionError with the log's tail (the process killed)."""
    attempt = 1
    while True:
        port = free_port()
        # each attempt its own temp dir, removed once its process object is gone (an attempt that
        # lost its port: as the next replaces it), or here if its server never started
        tmp = own_temp_dir("kvcraft-server-")
        try:
            with open(log_path, "w") as log:
                proc = subprocess.Popen(argv(port), env={**env, "VLLM_RPC_BASE_PATH": tmp, "TMPDIR": tmp}, stdout=log,
                                        stderr=subprocess.STDOUT)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        weakref.finalize(proc, shutil.rmtree, tmp, True)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while not answers(base + ready):
            exited = proc.poll() is not None
            if exited or time.monotonic() > deadline:
                text = log_path.read_text()
                if exited and PORT_TAKEN in text.lower() and attempt < ATTEMPTS:
                    break
                proc.kill()
                raise AssertionError(text[-4000:])
            time.sleep(0.5)  # polling for readiness, not timing a result
        else:
            return proc, base
        attempt += 1
