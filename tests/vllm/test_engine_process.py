"""The engine processes of the benchmarks and tests (`kvbench.common.engines`) leave nothing in
the temp dir: vLLM binds its ZMQ sockets as files under VLLM_RPC_BASE_PATH, and an engine that
ends in os._exit (every one does) or is killed never unlinks them."""

from __future__ import annotations

import os
import socket
import tempfile
import time

import pytest

from kvbench.common.engines import EngineProcess


def bind_like_vllm(argv: list[str]) -> int:
    """An engine's entry point: a unix socket bound where vLLM binds its ZMQ sockets (then the
    name of its folder written to argv[0]); with argv[1] "hang", it waits to be killed."""
    path = os.path.join(os.environ.get("VLLM_RPC_BASE_PATH", tempfile.gettempdir()), f"kvcraft-test-{os.getpid()}")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(path)
    with open(argv[0], "w") as f:
        f.write(path)
    while argv[1] == "hang":
        time.sleep(0.1)
    return 0


@pytest.mark.parametrize("end", ["exit", "hang"])
def test_an_engines_sockets_go_with_it(tmp_path, end):
    told = tmp_path / "bound"
    proc = EngineProcess(f"{__name__}:bind_like_vllm", [told, end], tmp_path / "engine.log").start()
    if end == "exit":
        assert proc.wait(120) == 0, (tmp_path / "engine.log").read_text()
    else:
        deadline = time.monotonic() + 120
        while not told.exists() or not told.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "engine.log").read_text()
            time.sleep(0.05)
        proc.kill()
    bound = told.read_text()
    assert os.path.dirname(bound) != tempfile.gettempdir()  # not among everyone's files
    assert not os.path.exists(bound) and not os.path.exists(os.path.dirname(bound))
