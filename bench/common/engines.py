"""vLLM engine processes for the benchmarks and the tests, started without re-importing vLLM.

Every vLLM instance a benchmark compares runs in its own process (a fresh engine, nothing
shared but the kvcraft service), and importing vLLM costs ~10 s of CPU on the 2-core VM,
more than an eager engine takes to start. So the processes are forked from one server that
imported vLLM once: the standard library's fork server (`multiprocessing`'s "forkserver"
start method, with vLLM preloaded). The server is started the first time an engine is, in
`engine_env()`'s environment; each engine then applies its own environment, sends its
output and log to a file and runs its entry point, a `module:function(argv) -> int`. What an
engine inherits from the server is frozen (`gc.freeze`): the full collections vLLM makes as it
starts and shuts down scan only what the engine made (an engine of the tests ~1.2 s sooner on the
2-core VM).

    out = engine_run(tmp, "alone", spec)      # kvbench.vllm.rag's engine through spec's phases
    outs = engines_in_turns(tmp, {"alone": a, "blend": b}, ["alone", "blend", "blend", ...])  # side by side
    proc = EngineProcess(ENGINE, [spec_path, out_path], log).start()   # to signal or watch it
    proc.wait(timeout=600)                    # the exit code; a process still running is killed
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import json
import logging
import multiprocessing
import os
import select
import shutil
import sys
import tempfile
import threading
import time
from multiprocessing import forkserver
from pathlib import Path
from typing import Any, Iterable, NoReturn, Sequence

ENGINE = "kvbench.vllm.rag:engine_main"  # a vLLM instance through a spec's phases (kvbench.vllm.rag.run)
ENGINE_TIMEOUT_S = 1800
# what every engine imports: once, in the fork server (its worker and Llama's layers: ~0.5 s an engine)
PRELOAD = ["vllm", "vllm.entrypoints.llm", "vllm.v1.worker.cpu_worker", "vllm.model_executor.models.llama"]

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


def own_temp_dir(prefix: str) -> str:
    """A new temp dir for a vLLM process to use as its TMPDIR, the caller to remove once the
    process has ended. A vLLM process ends in os._exit or a kill, so nothing it put in the temp
    dir is unlinked: its ZMQ sockets (files under VLLM_RPC_BASE_PATH, set to this dir too) and its
    executor's rendezvous file (vllm_dist_*, torch's FileStore). torch.compile's cache (graphs,
    kernels, precompiled headers) is torch's default cache dir, a folder of that name in the temp
    dir: linked from this dir to the shared one, so that every vLLM process, and every process
    it spawns (its tensor parallel workers), finds what another compiled. (TORCHINDUCTOR_CACHE_DIR
    would not do: torch places the precompiled headers in the default dir, ignoring it.)"""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    tmp = tempfile.mkdtemp(prefix=prefix)
    shared = default_cache_dir()
    os.makedirs(shared, exist_ok=True)
    os.symlink(shared, os.path.join(tmp, os.path.basename(shared)))
    return tmp


def _run(target: str, argv: Sequence[str], log: str, env: dict[str, str], starter: int) -> None:
    """In the forked engine process: its environment, its log, its entry point; then exit
    without waiting for vLLM's or gRPC's threads; or at once when `starter` is gone."""
    gc.freeze()  # what the server imported: out of every collection (the module docstring)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable(all_threads=True)  # a crash in native code logs every thread's Python stack
    os.environ.clear()
    os.environ.update(env)
    _exit_with(starter)
    tempfile.tempdir = None  # (the fork server's, if it asked): this engine's own, its TMPDIR
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
        exit_now(code)


def _exit_with(starter: int) -> None:
    """End this engine, and remove its temp dir, once the process that started it is gone
    (killed, crashed: it stops no engine then), as the service ends with its starter: else the
    engine, its model and its KV cache stay, waiting for a turn or a service that never comes."""
    def watch() -> None:
        try:
            with os.fdopen(os.pidfd_open(starter)) as gone:  # readable once the process has ended
                select.select([gone], [], [])
        except ProcessLookupError:  # gone already
            pass
        print(f"kvcraft: the process that started this engine ({starter}) is gone; ending", file=sys.stderr)
        shutil.rmtree(os.environ["TMPDIR"], ignore_errors=True)
        exit_now(1)

    threading.Thread(target=watch, name="kvcraft-starter-watch", daemon=True).start()


def exit_now(code: int) -> NoReturn:
    """End this engine process without waiting for vLLM's or gRPC's threads (os._exit), its
    output flushed and the semaphores it still holds unlinked, as a normal exit would: vLLM's
    executor makes one, tqdm's first progress bar another, and the resource tracker every
    engine shares with the process that started it would find them when it ends, clean them
    up and warn of them as leaked."""
    from multiprocessing import synchronize, util

    for cleanup in list(util._finalizer_registry.values()):
        if getattr(cleanup, "_callback", None) is synchronize.SemLock._cleanup:
            cleanup()  # (unlinks it, tells the tracker; runs once)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class EngineProcess:
    """One engine process: `target(argv)` with `env` (default `engine_env()`), stdout and
    stderr appended to `log`."""

    def __init__(self, target: str, argv: Sequence[str], log: str | Path, env: dict[str, str] | None = None) -> None:
        from kvbench.vllm.rag import engine_env

        self.log = Path(log)
        env = env if env is not None else engine_env()
        ctx = _context()
        self._tmp = own_temp_dir("kvcraft-engine-")  # removed when it has ended (`wait`, `kill`) or failed to start
        env = {**env, "VLLM_RPC_BASE_PATH": self._tmp, "TMPDIR": self._tmp}
        self._proc = ctx.Process(target=_run, args=(target, [str(a) for a in argv], str(self.log), env, os.getpid()),
                                 daemon=False)

    def start(self) -> EngineProcess:
        try:
            self._proc.start()
        except BaseException:
            shutil.rmtree(self._tmp, ignore_errors=True)  # no process will end to have it removed
            raise
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
        shutil.rmtree(self._tmp, ignore_errors=True)
        return self._proc.exitcode

    def kill(self) -> None:
        if self._proc.exitcode is None:
            self._proc.kill()
            self._proc.join(10)
        shutil.rmtree(self._tmp, ignore_errors=True)


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


class Turn:
    """In an engine process run by `engines_in_turns` (spec "turns": two FIFOs' paths): `with
    turn:` waits for the driver's go and reports done at the end, so that the engines take
    turns, one request each. Without "turns" it waits for nothing."""

    def __init__(self, fifos: dict[str, str] | None) -> None:
        self._go = os.open(fifos["go"], os.O_RDONLY) if fifos else None
        self._done = os.open(fifos["done"], os.O_WRONLY) if fifos else None

    def __enter__(self) -> None:
        if self._go is not None and not os.read(self._go, 1):
            raise RuntimeError("the engines' turn driver went away")

    def __exit__(self, *exc: object) -> None:
        if self._done is not None:
            os.write(self._done, b".")


def engines_in_turns(tmp: Path, specs: dict[str, dict[str, Any]], order: Iterable[str],
                     timeout: float = ENGINE_TIMEOUT_S, target: str = ENGINE,
                     progress: bool = True) -> dict[str, dict[str, Any]]:
    """Engine processes side by side, one request at a time across them: `order` names the
    engine of each turn (a request of its phases, in order; with spec "rest", its last turn
    the memory at rest). Each starts at once and waits for its first turn; a turn starts when
    the one before has ended, so a machine whose speed drifts slows each engine alike (the
    benchmarks compare engines in one run). Returns each engine's result (as `engine_run`).
    progress: a bar of the turns on stderr (an engine's first turn waits for its start)."""
    from rich.console import Console
    from rich.progress import track

    order = list(order)
    fifos, procs, ends = {}, {}, {}
    for name in specs:
        fifos[name] = {end: str(tmp / f"{name}.{end}") for end in ("go", "done")}
        for path in fifos[name].values():
            os.mkfifo(path)
        # read-write: neither open blocks, and the engine's own opens find the other end there
        ends[name] = {end: os.open(path, os.O_RDWR) for end, path in fifos[name].items()}
    try:
        for name, spec in specs.items():
            (tmp / f"{name}.json").write_text(json.dumps({**spec, "turns": fifos[name]}))
            (tmp / f"{name}.log").write_text("")
            argv = [tmp / f"{name}.json", tmp / f"{name}.out"]
            procs[name] = EngineProcess(target, argv, tmp / f"{name}.log").start()
        deadline = time.monotonic() + timeout
        turns = track(order, description=f"{len(specs)} engines in turns (each first starts)",
                      console=Console(stderr=True), disable=not progress)
        for name in turns:
            os.write(ends[name]["go"], b".")
            while not select.select([ends[name]["done"]], [], [], 1.0)[0]:
                if procs[name].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM engine {name!r} ended or stalled in its turn:\n"
                                       + (tmp / f"{name}.log").read_text()[-6000:])
            os.read(ends[name]["done"], 1)
        for name, proc in procs.items():
            if proc.wait(max(1.0, deadline - time.monotonic())) != 0:
                raise RuntimeError(f"vLLM engine {name!r} exited {proc.poll()}:\n"
                                   + (tmp / f"{name}.log").read_text()[-6000:])
        return {name: json.loads((tmp / f"{name}.out").read_text()) for name in specs}
    finally:
        for proc in procs.values():
            proc.kill()
        for fds in ends.values():
            for fd in fds.values():
                os.close(fd)
