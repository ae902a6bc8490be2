"""vLLM engine processes for the benchmarks and the tests, started without re-importing vLLM.

Every vLLM instance a benchmark compares runs in its own process (a fresh engine, nothing
shared but the kvcraft service), and importing vLLM costs ~10 s of CPU on the 2-core VM,
more than an eager engine takes to start. So the processes are forked from one server that
imported vLLM once: the standard library's fork server (`multiprocessing`'s "forkserver"
start method, with vLLM preloaded). The server is started the first time an engine is, in
`engine_env()`'s environment; each engine then applies its own environment, sends its
output and log to a file and runs its entry point, a `module:function(argv) -> int`.

    out = engine_run(tmp, "alone", spec)      # kvbench.vllm.rag's engine through spec's phases
    proc = EngineProcess(ENGINE, [spec_path, out_path], log).start()   # to signal or watch it
    proc.wait(timeout=600)                    # the exit code; a process still running is killed
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import logging
import multiprocessing
import os
import sys
from multiprocessing import forkserver
from pathlib import Path
from typing import Any, Sequence

ENGINE = "kvbench.vllm.rag:engine_main"  # a vLLM instance through a spec's phases (kvbench.vllm.rag.run)
ENGINE_TIMEOUT_S = 1800
PRELOAD = ["vllm", "vllm.entrypoints.llm"]  # what every engine imports first: once, in the fork server

_started = False


def _context() -> multiprocessing.context.BaseContext:
    """The fork server, started in `engine_env()`'s environment the first time."""
    global _started
    ctx = multiprocessing.get_context("forkserver")
    if not _started:
        from kvbench.vllm.rag import engine_env

        ctx.set_forkserver_preload(PRELOAD)
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(engine_env())
        try:
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _started = True
    return ctx


def _run(target: str, argv: Sequence[str], log: str, env: dict[str, str]) -> None:
    """In the forked engine process: its environment, its log, its entry point; then exit
    without waiting for vLLM's or gRPC's threads."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable(all_threads=True)  # a crash in native code logs every thread's Python stack
    os.environ.clear()
    os.environ.update(env)
    logging.getLogger("vllm").setLevel(env.get("VLLM_LOGGING_LEVEL", "INFO").upper())  # set at import, in the server
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    code = 1
    try:
        module, _, function = target.partition(":")
        code = getattr(importlib.import_module(module), function)(list(argv)) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class EngineProcess:
    """One engine process: `target(argv)` with `env` (default `engine_env()`), stdout and
    stderr appended to `log`."""

    def __init__(self, target: str, argv: Sequence[str], log: str | Path, env: dict[str, str] | None = None) -> None:
        from kvbench.vllm.rag import engine_env

        self.log = Path(log)
        self._proc = _context().Process(target=_run, args=(target, [str(a) for a in argv], str(self.log),
                                                           env if env is not None else engine_env()), daemon=False)

    def start(self) -> EngineProcess:
        self._proc.start()
        return self

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def poll(self) -> int | None:
        """The exit code, or None while it runs."""
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Wait up to `timeout` s for the exit code; an engine still running then is killed and
        TimeoutError raised."""
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            self.kill()
            raise TimeoutError(f"engine process {self.pid} still running after {timeout} s (log: {self.log})")
        return self._proc.exitcode

    def kill(self) -> None:
        if self._proc.exitcode is None:
            self._proc.kill()
            self._proc.join(10)


def engine_run(tmp: Path, name: str, spec: dict[str, Any], timeout: float = ENGINE_TIMEOUT_S,
               target: str = ENGINE, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One engine process through `spec`: tmp/name.json (the spec), tmp/name.log (its output),
    tmp/name.out (its result, returned). RuntimeError with the log's tail if it fails."""
    (tmp / f"{name}.json").write_text(json.dumps(spec))
    log = tmp / f"{name}.log"
    log.write_text("")
    code = EngineProcess(target, [tmp / f"{name}.json", tmp / f"{name}.out"], log, env).start().wait(timeout)
    if code != 0:
        text = log.read_text()
        crash = text.find("Fatal Python error")  # a native crash: every thread's stack from there
        raise RuntimeError(f"vLLM engine {name!r} exited {code}:\n"
                           + (text[crash:crash + 20000] if crash >= 0 else text[-6000:]))
    return json.loads((tmp / f"{name}.out").read_text())
