"""What a test run must not leave behind: processes it started (kvcraft serve, vLLM engines,
mooncake_master, their helpers), shared-memory segments, data dirs and vLLM's files in the
temporary folder, and the network namespaces of simulated hosts (kvbench.common.netns; their
links and addresses go with them). The run's first process marks its environment; every process it starts inherits
the mark, so a process still carrying it after the run is one the run left running.
Segments carry no such mark: a run beside another run on the same machine counts the
other's segments too (CI runs one at a time).
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvbench.common import netns

MARK = "KVCRAFT_TEST_RUN"
SHM = Path("/dev/shm")
# what the run's own things name in the temporary folder: kvcraft's folders, and a vLLM engine's
# rendezvous file (its executor's torch.distributed FileStore)
TMP_PREFIXES = ("kvcraft", "vllm_dist_")
EXIT_WAIT_S = 10.0  # a process killed at the very end still needs a moment to be reaped


@dataclass(frozen=True)
class Before:
    run: str
    shm: frozenset[str]
    tmp: frozenset[str]
    namespaces: frozenset[str]


BEFORE = pytest.StashKey[Before]()


def start() -> Before:
    """Mark this process's environment (inherited by everything it starts); note what
    /dev/shm and the temporary folder hold already."""
    run = uuid.uuid4().hex
    os.environ[MARK] = run
    return Before(run, _names(SHM), _names(Path(tempfile.gettempdir())), frozenset(netns.namespaces()))


def left_behind(before: Before) -> list[str]:
    """What the run left: marked processes, new segments, new kvcraft dirs and vLLM files in the
    temporary folder."""
    deadline = time.monotonic() + EXIT_WAIT_S
    while (procs := _marked(before.run)) and time.monotonic() < deadline:
        time.sleep(0.2)
    found = [f"process {pid}: {cmd}" for pid, cmd in procs]
    found += [f"/dev/shm/{n}" for n in sorted(_names(SHM) - before.shm)]
    tmp = Path(tempfile.gettempdir())
    found += [str(tmp / n) for n in sorted(_names(tmp) - before.tmp) if n.startswith(TMP_PREFIXES)]
    found += [f"network namespace {n}" for n in sorted(set(netns.namespaces()) - before.namespaces)]
    return found


def _names(folder: Path) -> frozenset[str]:
    try:
        return frozenset(p.name for p in folder.iterdir())
    except FileNotFoundError:
        return frozenset()


# multiprocessing's helpers of this very process (run without workers: -n 0): they end with it.
OWN_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _marked(run: str) -> list[tuple[int, str]]:
    """Live processes, other than this one and its own multiprocessing helpers, whose
    environment carries the run's mark."""
    needle = f"{MARK}={run}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            if state == "Z":
                continue  # exited, not yet reaped by its parent
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if int(ppid) == os.getpid() and any(h in cmd for h in OWN_HELPERS):
            continue
        found.append((int(entry.name), cmd[:200]))
    return found
