"""`engine_adapter.threads.one_omp_thread`: a thread of kvcraft's runs torch's CPU operations
without an OpenMP team of its own, and the thread that owns the compute keeps its team.

In a fresh process with two OpenMP threads (the suite's workers run one): the main thread runs
a parallel operation (its team: itself and one OpenMP thread), then a second thread runs one
too. Without the call that thread starts a team (one more thread in the process, which stays);
with it, none."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, os, sys, threading
import torch
from engine_adapter.threads import one_omp_thread

x = torch.randn(256, 4096)  # over torch's grain size: a parallel region
def tasks():
    return len(os.listdir("/proc/self/task"))
x.mul(2.0)
before, seen = tasks(), {}
def aux(alone):
    if alone:
        one_omp_thread()
    seen["threads"] = torch.get_num_threads()
    x.mul(2.0)
    seen["tasks"] = tasks() - 1  # less this thread
t = threading.Thread(target=aux, args=(sys.argv[1] == "alone",))
t.start()
t.join()
print(json.dumps({"before": before, "during": seen["tasks"], "aux_threads": seen["threads"],
                  "main_threads": torch.get_num_threads()}))
"""


def _run(mode: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_thread_on_one_omp_thread_starts_no_team_and_the_main_keeps_its_own():
    team = _run("team")  # the reference: without the call the second thread starts a team
    assert team["aux_threads"] == 2 and team["during"] == team["before"] + 1, team
    alone = _run("alone")
    assert alone["aux_threads"] == 1 and alone["during"] == alone["before"], alone
    assert alone["main_threads"] == 2
