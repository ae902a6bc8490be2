"""A data dir another live process holds is refused as in use, naming that process, never
reported as damaged: `kvcraft serve` and `kvcraft repair` both refuse it, change nothing,
and the service holding it keeps serving. And what lets a data dir go: the dir removed under its
service, the program that started the service gone (before or after it began), never a
ready line nobody reads."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvclient.client import KVClient
from kvcraft.keys import ModelSpec
from kvservice.cli import exited
from kvservice.config import load_config
from kvservice.datadir import DataDirInUse
from kvservice.launcher import ServiceProcess
from kvservice.metadata import MetadataDB
from kvservice.store import ChunkStore
from tests.conftest import random_layers

MODEL = ModelSpec("in-use", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32").fingerprint()
TOKENS = [5, 6, 7, 8]


def _kvcraft(*argv: str) -> subprocess.CompletedProcess:
    """The `kvcraft` command as users run it (its front, `kvcli.main`)."""
    return subprocess.run([sys.executable, "-m", "kvcli.main", *argv], capture_output=True, text=True, timeout=120)


def _tree(data: Path) -> dict[str, bytes]:
    """Every file of the data dir and its bytes, the lock file aside (its holder writes it)."""
    return {str(p.relative_to(data)): p.read_bytes() for p in sorted(data.rglob("*"))
            if p.is_file() and p.name != "kvcraft.lock" and p.parent.name != "metadata"}


def test_a_second_service_on_a_port_in_use_is_refused_and_the_first_serves_every_client(tmp_path):
    """grpc lets listeners share a port (SO_REUSEPORT): a second service on another data dir once
    started there, and the kernel spread new clients over two stores (a chunk stored through one
    connection was missing through the next). Its start fails naming the address; a metrics port
    in use likewise; every client then reaches the first service."""
    with ServiceProcess(tmp_path / "first") as first, KVClient(first.address) as c:
        port = first.address.rsplit(":", 1)[1]
        key = c.store(MODEL, TOKENS, random_layers(1)).chunk_key
        serve = _kvcraft("serve", "--data-dir", str(tmp_path / "second"), "--host", "127.0.0.1", "--port", port)
        assert serve.returncode == 1 and "kvcraft serving on" not in serve.stdout, serve.stdout + serve.stderr
        assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in serve.stderr
        assert "Traceback" not in serve.stderr
        metrics = _kvcraft("serve", "--data-dir", str(tmp_path / "third"), "--host", "127.0.0.1", "--port", "0",
                           "--metrics-port", port)
        assert metrics.returncode == 1 and f"cannot serve metrics on 127.0.0.1:{port} (metrics_port)" in metrics.stderr
        for _ in range(8):  # new connections: each reaches the one service that holds the chunk
            with KVClient(first.address) as again:
                assert again.lookup(chunk_key=key).found


def test_serve_and_repair_refuse_a_live_data_dir_naming_its_holder_and_it_keeps_serving(tmp_path):
    data = tmp_path / "data"
    with ServiceProcess(data) as first, KVClient(first.address) as c:
        key = c.store(MODEL, TOKENS, random_layers(1)).chunk_key
        holder = first.proc.pid
        metadata_files = sorted(p.name for p in (data / "metadata").iterdir())
        before = _tree(data)

        serve = _kvcraft("serve", "--data-dir", str(data), "--host", "127.0.0.1", "--port", "0")
        assert serve.returncode == 2, serve.stderr
        assert f"data dir {data} is in use by process {holder}" in serve.stderr, serve.stderr
        assert "kvservice.cli serve" in serve.stderr  # the holder's command line, from the kernel's lock table
        assert "is damaged" not in serve.stderr and "metadata in" not in serve.stderr and "Traceback" not in serve.stderr

        repair = _kvcraft("repair", "--data-dir", str(data))
        assert repair.returncode == 2, repair.stderr
        assert "refused, nothing was changed" in repair.stderr and f"in use by process {holder}" in repair.stderr
        assert not list(data.glob("metadata.damaged-*"))  # the live metadata was not moved aside
        assert sorted(p.name for p in (data / "metadata").iterdir()) == metadata_files
        assert _tree(data) == before

        got = c.fetch(key)  # the first service still serves what it held, bit for bit, and takes more
        assert all(torch.equal(a, b) and torch.equal(x, y) for (a, x), (b, y) in zip(got, random_layers(1)))
        c.store(MODEL, [9, 10, 11, 12], random_layers(2))
        assert c.stats().variants == 2
    # Refused because it was held, not for anything in the data dir: once the holder is gone,
    # the same data dir serves.
    with ServiceProcess(data) as second, KVClient(second.address) as c:
        assert c.stats().variants == 2


def test_a_second_store_in_one_process_is_refused_as_in_use(tmp_path):
    cfg = load_config(env={}, overrides={"data_dir": str(tmp_path / "data"), "host_budget_bytes": 1 << 20})
    store = ChunkStore(cfg)
    try:
        with pytest.raises(DataDirInUse, match="is in use by pid") as e:
            ChunkStore(cfg)
        assert "is damaged" not in str(e.value) and "metadata in" not in str(e.value)
    finally:
        store.close()
    ChunkStore(cfg).close()  # released at close


HOLD_METADATA = """
import sys, time
from kvservice.metadata import MetadataDB
db = MetadataDB(sys.argv[1])
print("open", flush=True)
time.sleep(120)
"""


def test_metadata_held_without_the_data_dir_lock_is_in_use_naming_the_process(tmp_path):
    """A process that holds the metadata through RocksDB's own lock alone (another tool, an
    older build) is named from the kernel's lock table: in use, not damaged."""
    path = tmp_path / "data" / "metadata"
    path.parent.mkdir()
    other = subprocess.Popen([sys.executable, "-c", HOLD_METADATA, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "open"
        with pytest.raises(DataDirInUse, match=f"is in use by process {other.pid} ") as e:
            MetadataDB(path)
        assert "is damaged" not in str(e.value) and "metadata in" not in str(e.value)
    finally:
        other.kill()
        other.wait()
    MetadataDB(path).close()  # the holder gone, it opens


def test_a_data_dir_removed_and_made_again_under_a_service_stops_it_before_a_second_service_writes_there(tmp_path):
    data = tmp_path / "data"
    first = ServiceProcess(data).start()
    try:
        with KVClient(first.address) as c:
            c.store(MODEL, TOKENS, random_layers(1))
        shutil.rmtree(data)  # an operator's `rm -rf data && mkdir data` with the service still running
        data.mkdir()
        assert first.proc.wait(timeout=30) == 3
        assert "kvcraft.lock was removed: stopping now, writing nothing more (exit code 3)" in first.log()
        with ServiceProcess(data) as second, KVClient(second.address) as c:  # the new dir is its alone
            key = c.store(MODEL, TOKENS, random_layers(2)).chunk_key
            got = c.fetch(key)
            assert all(torch.equal(a, b) and torch.equal(x, y) for (a, x), (b, y) in zip(got, random_layers(2)))
    finally:
        first.close()


def test_a_service_started_by_a_process_that_is_killed_drains_and_lets_go_of_its_data_dir(tmp_path):
    """The launcher's services (tests, benchmarks, the demo) set exit_with_parent: end the
    program that started one (even the moment it is ready) and the service stops, so the next
    run can take the data dir."""
    data = tmp_path / "data"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import os, sys; from pathlib import Path; from kvservice.launcher import ServiceProcess\n"
        "s = ServiceProcess(Path(sys.argv[1])).start(); print(s.proc.pid, flush=True); os._exit(9)"),
        str(data)], stdout=subprocess.PIPE, text=True)  # gone, uncleaned, the moment its service is ready
    service = int(parent.stdout.readline())
    assert parent.wait() == 9
    deadline = time.monotonic() + 30
    while True:  # the orphan's lock goes when it exits: until then a second service is refused
        try:
            with ServiceProcess(data) as second, KVClient(second.address) as c:
                c.store(MODEL, TOKENS, random_layers(1))
            break
        except RuntimeError as e:
            assert f"in use by process {service}" in str(e), e
            assert time.monotonic() < deadline, f"the service {service} outlived the process that started it"
    assert "has exited: draining (exit_with_parent)" in (tmp_path / "data-server.log").read_text()


def test_a_service_whose_starter_is_gone_before_it_begins_drains_at_once(tmp_path):
    """A starter that dies before the service's Python has begun (the service an orphan from its
    first line: its parent then is not the starter) is noticed too: the launcher names itself
    (`KVCRAFT_STARTER_PID`), and the service drains at its first check."""
    import os
    import signal

    data, log = tmp_path / "data", tmp_path / "orphan.log"
    cfg = tmp_path / "orphan.toml"
    cfg.write_text(f'host = "127.0.0.1"\nport = 0\ndata_dir = "{data}"\n')
    starter = subprocess.Popen([sys.executable, "-c", (
        "import os, subprocess, sys\n"
        "p = subprocess.Popen(['sh', '-c', 'sleep 2; exec \"$@\"', 'sh', sys.executable, '-m', 'kvservice.cli', "
        "'serve', '--config', sys.argv[1]], stdout=open(sys.argv[2], 'w'), stderr=subprocess.STDOUT, "
        "env={**os.environ, 'KVCRAFT_EXIT_WITH_PARENT': 'true', 'KVCRAFT_STARTER_PID': str(os.getpid())})\n"
        "print(p.pid, flush=True); os._exit(9)"), str(cfg), str(log)], stdout=subprocess.PIPE, text=True)
    service = int(starter.stdout.readline())
    assert starter.wait() == 9
    deadline = time.monotonic() + 30
    try:
        while "has exited: draining (exit_with_parent)" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, f"the service {service} outlived its starter: {log.read_text()}"
            time.sleep(0.2)
        while not exited(service):
            assert time.monotonic() < deadline, f"the service {service} did not stop"
            time.sleep(0.2)
    finally:
        try:
            os.kill(service, signal.SIGKILL)
        except ProcessLookupError:
            pass
    with ServiceProcess(data) as second, KVClient(second.address) as c:  # the data dir is free again
        c.store(MODEL, TOKENS, random_layers(1))


def test_a_service_whose_ready_line_nobody_reads_serves_on(tmp_path):
    """stdout's reader gone before the ready line (a starter that read nothing): the service
    serves on and says where in its log, rather than dying of a broken pipe."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data, log = tmp_path / "data", tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kvservice.cli", "serve", "--port", str(port), "--data-dir",
                                 str(data)], stdout=subprocess.PIPE, stderr=err)
    proc.stdout.close()
    try:
        deadline = time.monotonic() + 60
        while "stdout is closed: kvcraft serving on" not in log.read_text():
            assert proc.poll() is None, f"the service exited ({proc.returncode}): {log.read_text()}"
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        with KVClient(f"127.0.0.1:{port}") as c:
            layers = random_layers(1)
            got = c.fetch(c.store(MODEL, TOKENS, layers).chunk_key)
            assert all(torch.equal(a, b) for x, y in zip(got, layers) for a, b in zip(x, y))
        assert proc.poll() is None
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, log.read_text()


def test_a_data_dir_that_is_a_file_is_refused_naming_it(tmp_path):
    (tmp_path / "data").write_text("not a directory")
    for where in (tmp_path / "data", tmp_path / "data" / "below"):
        serve = _kvcraft("serve", "--data-dir", str(where), "--host", "127.0.0.1", "--port", "0")
        assert serve.returncode == 2 and f"cannot use data_dir {where}: " in serve.stderr, serve.stderr
        assert "Traceback" not in serve.stderr
    assert (tmp_path / "data").read_text() == "not a directory"
