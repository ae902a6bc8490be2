"""The run's own check (tests/leaks.py, wired in tests/conftest.py) fails a run that passed
every test but left a process, a /dev/shm segment, a kvcraft temporary dir, a vLLM engine's
rendezvous file or a simulated host's network namespace behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

from kvbench.common import netns

ROOT = Path(__file__).resolve().parents[1]


def _pytest_with_the_suites_hooks(test_file: Path) -> subprocess.CompletedProcess:
    """A pytest run of `test_file` alone, in one process, with tests/conftest.py's hooks."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           str(test_file)], cwd=test_file.parent, env=env, capture_output=True, text=True, timeout=120)


def test_a_run_that_leaves_things_behind_fails_and_names_each(tmp_path):
    tag = uuid.uuid4().hex[:12]
    shm = Path("/dev/shm") / f"kvcraft-leak-{tag}"
    tmp_dir = Path(tempfile.gettempdir()) / f"kvcraft-leak-{tag}"
    rendezvous = Path(tempfile.gettempdir()) / f"vllm_dist_{tag}"  # a vLLM engine's
    pid_file = tmp_path / "pid"
    ns = f"{netns.NAME}-leak-{tag}" if netns.unavailable() is None else ""  # a simulated host's namespace, as root
    (tmp_path / "test_leaky.py").write_text(textwrap.dedent(f"""
        import subprocess, sys
        from pathlib import Path

        def test_passes_but_leaves_things():
            p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            Path({str(pid_file)!r}).write_text(str(p.pid))
            Path({str(shm)!r}).write_bytes(b"x")
            Path({str(tmp_dir)!r}).mkdir()
            Path({str(rendezvous)!r}).write_bytes(b"x")
            if {ns!r}:
                subprocess.run(["ip", "netns", "add", {ns!r}], check=True)
    """))
    try:
        run = _pytest_with_the_suites_hooks(tmp_path / "test_leaky.py")
        out = run.stdout + run.stderr
        assert "1 passed" in out, out
        assert run.returncode == 1, out
        leaked_pid = pid_file.read_text()
        assert "left behind by this run" in out and f"process {leaked_pid}:" in out, out
        assert str(shm) in out and str(tmp_dir) in out and str(rendezvous) in out, out
        assert not ns or f"network namespace {ns}" in out, out
    finally:
        if ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
        shm.unlink(missing_ok=True)
        rendezvous.unlink(missing_ok=True)
        shutil.rmtree(tmp_dir, ignore_errors=True)


def test_a_clean_run_passes(tmp_path):
    (tmp_path / "test_clean.py").write_text("def test_nothing_left():\n    assert True\n")
    run = _pytest_with_the_suites_hooks(tmp_path / "test_clean.py")
    assert run.returncode == 0, run.stdout + run.stderr
