"""The engine processes of the benchmarks and tests (`kvbench.common.engines`) leave nothing
behind and share torch.compile's cache: vLLM binds its ZMQ sockets as files under
VLLM_RPC_BASE_PATH, its executor makes a rendezvous file in the temp dir (`vllm_dist_*`) and a
semaphore, and an engine that ends in os._exit (every one does) or is killed never unlinks them;
each engine's temp dir is its own, with torch's cache dir linked to the shared one."""

from __future__ import annotations

import os
import shutil
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


def report_compile_cache(argv: list[str]) -> int:
    """An engine's entry point: writes to argv[0] where torch.compile's cache and its precompiled
    headers resolve in this engine (torch places the headers by the temp dir when
    `torch._inductor.codecache` is first imported, as in an engine) and in a process it spawns
    as vLLM spawns its tensor parallel workers (a fresh interpreter, this environment)."""
    import subprocess
    import sys

    from torch._inductor import codecache
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    spawned = subprocess.run([sys.executable, "-c", "import os; from torch._inductor import codecache; "
                              "print(os.path.realpath(codecache._HEADER_DIR))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    with open(argv[0], "w") as f:
        f.write("\n".join([os.path.realpath(cache_dir()), os.path.realpath(codecache._HEADER_DIR), spawned]))
    return 0


def test_every_engine_shares_torch_compiles_cache(tmp_path):
    """A compiled engine (or vLLM's eager one, which compiles its custom ops' native forward)
    finds what an engine before it compiled: were the precompiled headers in its own temp dir,
    every engine would rebuild them (~13 s of CPU here)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    shared = os.path.realpath(default_cache_dir())
    told = tmp_path / "cache"
    assert EngineProcess(f"{__name__}:report_compile_cache", [told], tmp_path / "engine.log").start().wait(120) == 0, \
        (tmp_path / "engine.log").read_text()
    graphs, headers, spawned_headers = told.read_text().splitlines()
    assert graphs == shared
    assert headers == spawned_headers == os.path.join(shared, "precompiled_headers")


_held = None  # (`hold_a_semaphore`'s lock, kept until its engine ends)


def hold_a_semaphore(argv: list[str]) -> int:
    """An engine's entry point: makes a semaphore as vLLM's executor and tqdm do (a lock of a
    start method that names it and registers it with the resource tracker), keeps it, and
    writes where it is to argv[0]."""
    import multiprocessing

    global _held
    _held = multiprocessing.get_context("spawn").Lock()
    with open(argv[0], "w") as f:
        f.write("/dev/shm/sem." + _held._semlock.name.lstrip("/"))
    return 0


def test_an_engine_leaves_no_semaphore_for_the_resource_tracker(tmp_path):
    """An engine ends in os._exit, which runs no finalizer: the semaphores it holds would stay in
    /dev/shm until the resource tracker shared with this process ends, which then warns of them
    as leaked (at the end of every `kvcraft bench vllm-*` run)."""
    told = tmp_path / "semaphore"
    assert EngineProcess(f"{__name__}:hold_a_semaphore", [told], tmp_path / "engine.log").start().wait(120) == 0, \
        (tmp_path / "engine.log").read_text()
    assert told.read_text().startswith("/dev/shm/sem.mp-")
    assert not os.path.exists(told.read_text())


DRIVER = """
import sys, time
from kvbench.common import engines
engines.PRELOAD[:] = []  # (its fork server imports no vLLM: this engine runs none)
target = "tests.vllm.test_engine_process:bind_like_vllm"
proc = engines.EngineProcess(target, [sys.argv[1], "hang"], sys.argv[2]).start()
print(proc.pid, flush=True)
time.sleep(600)
"""


def test_an_engine_ends_and_takes_its_temp_dir_when_the_process_that_started_it_is_killed(tmp_path):
    """A benchmark killed outright (SIGKILL, an out-of-memory kill: nothing of it runs after)
    leaves no engine holding its model and KV cache: the engine ends itself and removes its
    temp dir, as the service ends with its starter."""
    import subprocess
    import sys
    from pathlib import Path

    from kvservice.cli import exited

    told = tmp_path / "bound"
    # the killed driver's temp dir, where what it leaves goes (short: vLLM's sockets are bound under it)
    tmp = tempfile.mkdtemp(prefix="kvcraft-test-")
    try:
        driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(told), str(tmp_path / "engine.log")],
                                  stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2],
                                  env={**os.environ, "TMPDIR": tmp})
        try:
            engine = int(driver.stdout.readline())
            deadline = time.monotonic() + 120
            while not told.exists() or "\n" not in told.read_text():  # its entry point runs
                assert time.monotonic() < deadline and not exited(engine), (tmp_path / "engine.log").read_text()
                time.sleep(0.05)
        finally:
            driver.kill()
            driver.wait()
        deadline = time.monotonic() + 60
        while not exited(engine):
            assert time.monotonic() < deadline, "the engine outlived its starter by a minute"
            time.sleep(0.05)  # polling for the engine's end, not timing it
        assert "the process that started this engine" in (tmp_path / "engine.log").read_text()
        assert not os.path.exists(os.path.dirname(told.read_text().splitlines()[0]))  # its temp dir
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
