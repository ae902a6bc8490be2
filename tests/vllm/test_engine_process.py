"""The engine processes of the benchmarks and tests (`kvbench.common.engines`) leave nothing in
the temp dir: vLLM binds its ZMQ sockets as files under VLLM_RPC_BASE_PATH and its executor
makes a rendezvous file in the temp dir (`vllm_dist_*`), and an engine that ends in os._exit
(every one does) or is killed never unlinks them."""

from __future__ import annotations

import os
import socket
import tempfile
import time

import pytest

from kvbench.common.engines import EngineProcess


def bind_like_vllm(argv: list[str]) -> int:
    """An engine's entry point: a unix socket bound where vLLM binds its ZMQ sockets and a
    rendezvous file where vLLM makes it (`vllm.utils.network_utils.get_file_store_init_method`),
    their paths written to argv[0]; with argv[1] "hang", it waits to be killed."""
    path = os.path.join(os.environ.get("VLLM_RPC_BASE_PATH", tempfile.gettempdir()), f"kvcraft-test-{os.getpid()}")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(path)
    rendezvous = os.path.join(tempfile.gettempdir(), f"vllm_dist_kvcraft-test-{os.getpid()}")
    open(rendezvous, "w").close()
    with open(argv[0], "w") as f:
        f.write(f"{path}\n{rendezvous}")
    while argv[1] == "hang":
        time.sleep(0.1)
    return 0


@pytest.mark.parametrize("end", ["exit", "hang"])
def test_an_engines_sockets_and_temp_files_go_with_it(tmp_path, end):
    told = tmp_path / "bound"
    proc = EngineProcess(f"{__name__}:bind_like_vllm", [told, end], tmp_path / "engine.log").start()
    if end == "exit":
        assert proc.wait(120) == 0, (tmp_path / "engine.log").read_text()
    else:
        deadline = time.monotonic() + 120
        while not told.exists() or "\n" not in told.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "engine.log").read_text()
            time.sleep(0.05)
        proc.kill()
    for made in told.read_text().splitlines():
        assert os.path.dirname(made) != tempfile.gettempdir()  # not among everyone's files
        assert not os.path.exists(made) and not os.path.exists(os.path.dirname(made))
