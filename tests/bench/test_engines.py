"""kvbench.common.engines: engine processes forked from the fork server, each with its own
environment and log, their failures and hangs reported, not hidden."""

from __future__ import annotations

import errno
import gc
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

from kvbench.common.engines import EngineProcess, Turn, engine_run, engines_in_turns

pytestmark = pytest.mark.slow  # over ~10 s: after the inner loop (README, "Developing")

HERE = "tests.bench.test_engines"


def writes_its_environment(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    print("engine says hello")
    Path(argv[1]).write_text(json.dumps({"env": os.environ.get(spec["name"]), "pid": os.getpid(),
                                         "vllm_imported": "vllm" in sys.modules, "frozen": gc.get_freeze_count(),
                                         "collected": len(gc.get_objects())}))
    return 0


def fails(argv: list[str]) -> int:
    print("engine failing on purpose")
    return 3


def raises(argv: list[str]) -> int:
    raise ValueError("no such model")


def hangs(argv: list[str]) -> int:
    time.sleep(600)
    return 0


def takes_turns(argv: list[str]) -> int:
    """Each of its spec's "turns" requests: when it started and ended; with "die_at", exit there."""
    spec = json.loads(Path(argv[0]).read_text())
    turn, spans = Turn(spec["turns"]), []
    for i in range(spec["requests"]):
        with turn:
            if i == spec.get("die_at"):
                os._exit(5)
            start = time.monotonic()
            sum(range(200_000))  # some work in the turn
            spans.append((start, time.monotonic()))
    Path(argv[1]).write_text(json.dumps({"spans": spans}))
    return 0


def test_engines_take_turns_in_the_order_given(tmp_path):
    order = ["a", "a", "b", "a", "b", "b", "a"]
    outs = engines_in_turns(tmp_path, {"a": {"requests": 4}, "b": {"requests": 3}}, order, timeout=120,
                            target=f"{HERE}:takes_turns")
    spans = {name: iter(out["spans"]) for name, out in outs.items()}
    timeline = [(name, *next(spans[name])) for name in order]
    for (_, _, end), (_, start, _) in zip(timeline, timeline[1:]):
        assert end <= start  # one request at a time across the processes, in the order given


def test_an_engine_that_dies_in_its_turn_is_reported_with_its_log(tmp_path):
    with pytest.raises(RuntimeError, match="'b' ended or stalled in its turn"):
        engines_in_turns(tmp_path, {"a": {"requests": 2}, "b": {"requests": 2, "die_at": 1}},
                         ["a", "b", "b", "a"], timeout=120, target=f"{HERE}:takes_turns")


def test_an_engine_runs_in_its_own_process_with_its_environment_and_log(tmp_path):
    out = engine_run(tmp_path, "ok", {"name": "KVCRAFT_TEST_VALUE"}, timeout=120, target=f"{HERE}:writes_its_environment",
                     env={**os.environ, "KVCRAFT_TEST_VALUE": "42"})
    assert out["env"] == "42" and out["pid"] != os.getpid()
    assert out["vllm_imported"] == (importlib.util.find_spec("vllm") is not None)  # preloaded by the fork server
    # what the server imported is frozen: the collections vLLM makes at its start and shutdown
    # (~0.4 s each over every object vLLM and torch made) scan only what the engine made since
    assert out["frozen"] > out["collected"]
    assert "engine says hello" in (tmp_path / "ok.log").read_text()
    assert "KVCRAFT_TEST_VALUE" not in os.environ


@pytest.mark.parametrize("target, said", [("fails", "engine failing on purpose"), ("raises", "ValueError: no such model")])
def test_a_failing_engine_raises_with_its_log(tmp_path, target, said):
    with pytest.raises(RuntimeError, match="exited") as e:
        engine_run(tmp_path, target, {}, timeout=120, target=f"{HERE}:{target}")
    assert said in str(e.value)


def test_an_engine_that_cannot_start_leaves_no_temp_dir(tmp_path, monkeypatch):
    proc = EngineProcess(f"{HERE}:fails", [], tmp_path / "never.log")
    assert os.path.isdir(proc._tmp)

    def cannot_fork() -> None:  # the fork server out of processes
        raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))

    monkeypatch.setattr(proc._proc, "start", cannot_fork)
    with pytest.raises(OSError, match="temporarily unavailable"):
        proc.start()
    assert not os.path.exists(proc._tmp)


def test_an_engine_past_its_timeout_is_killed(tmp_path):
    proc = EngineProcess(f"{HERE}:hangs", [], tmp_path / "hang.log").start()
    with pytest.raises(TimeoutError, match="still running"):
        proc.wait(timeout=1)
    assert proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)
