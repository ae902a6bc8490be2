"""A Mooncake cluster across simulated hosts: the master and three kvcraft nodes, each in a
network namespace of its own (kvbench.common.netns), configured as docs/scale-out.md tells an
operator to, and an engine process (the trained quality model behind a RAGAdapter) on
each node's host. This process is the operator: it reaches every host through the switch.

Skipped, with the reason, where namespaces cannot be made (not root, no `ip`).
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from kvbench.common import netns
from kvbench.quality.modeling import MODEL_DIR
from kvservice.cluster.master import MasterProcess
from kvservice.cluster.mooncake import MooncakeClient, RemoteSettings
from kvservice.cluster.view import ClusterView
from kvservice.launcher import ServiceProcess

MiB = 1 << 20
NODES = ("a", "b", "c")
NAMESPACE = "kvcluster"  # remote_namespace: the key prefix in the cluster
CLIENT_TTL_S = 4  # the master's client_ttl: a dead node's objects leave after it
ROOT = Path(__file__).resolve().parents[2]


class Engine:
    """tests.cluster.engine_worker in a host's namespace, one JSON line each way."""

    def __init__(self, prefix: list[str], log: Path) -> None:
        self.log_path = log
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(prefix + [sys.executable, "-m", "tests.cluster.engine_worker"], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        assert self._read(120.0) == {"ready": True}

    def send(self, **req: object) -> None:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()

    def _read(self, timeout: float) -> dict:
        if not self._sel.select(timeout):
            raise AssertionError(f"engine gave no answer within {timeout:.0f}s; its log:\n{self.log()[-3000:]}")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"engine exited ({self.proc.wait()}); its log:\n{self.log()[-3000:]}")
        return json.loads(line)

    def result(self, timeout: float = 120.0) -> dict:
        return self._read(timeout)

    def prefill(self, service: str, prompt: int, timeout: float = 120.0) -> dict:
        self.send(service=service, prompt=prompt)
        return self.result(timeout)

    def flush(self, service: str) -> None:
        self.send(service=service, flush=True)
        assert self.result() == {"flushed": True}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class Cluster:
    def __init__(self, net: netns.Network, tmp: Path) -> None:
        self.net = net
        self.tmp = tmp
        self.master = MasterProcess(tmp / "master.log", host=net.address("m"), prefix=net.prefix("m"),
                                    client_ttl_s=CLIENT_TTL_S)
        self.nodes: dict[str, ServiceProcess] = {}
        self.engines: dict[str, Engine] = {}
        self._view: ClusterView | None = None
        self.seen: dict[str, list[dict]] = {}  # fault -> the engine answers while it lasted (the summary)
        self.measured: dict[str, float] = {}  # what a test timed (the summary)

    def saw(self, fault: str, answers: list[dict]) -> None:
        self.seen.setdefault(fault, []).extend(answers)

    def summary(self) -> str:
        """Per fault: requests, chunks reused / computed, wrong answers, slowest request."""
        lines = ["fault | requests | chunks reused | chunks computed | wrong answers | max request s"]
        for fault, rs in self.seen.items():
            computed, fallbacks = sum(r["chunks"] - r["reused"] for r in rs), sum(r["fallbacks"] for r in rs)
            lines.append(f"{fault} | {len(rs)} | {sum(r['reused'] for r in rs)} | "
                         f"{computed} (+{fallbacks} layer fallbacks) | "
                         f"{sum(r['answer'] != r['full_answer'] for r in rs)} | {max(r['ttft_s'] for r in rs):.2f}")
        lines += [f"{what}: {value:.3f}" for what, value in self.measured.items()]
        return "\n".join(lines)

    def node(self, name: str, **settings: object) -> ServiceProcess:
        """kvcraft serve on host `name`, as docs/scale-out.md configures a node: it listens
        on its host's address; the segment's address and the advertised one are derived."""
        return ServiceProcess(self.tmp / f"node-{name}", prefix=self.net.prefix(name), host=self.net.address(name),
                              remote_master=self.master.address, remote_namespace=NAMESPACE,
                              remote_segment_bytes=64 * MiB, remote_buffer_bytes=16 * MiB, drain_s=0.2, **settings)

    def address(self, name: str) -> str:
        return self.nodes[name].address

    @property
    def view(self) -> ClusterView:
        """The operator's view of the cluster (a Mooncake client that contributes no segment)."""
        if self._view is None:
            client = MooncakeClient(RemoteSettings(self.master.address, segment_bytes=0, buffer_bytes=16 * MiB))
            self._view = ClusterView(client, NAMESPACE, holder="operator")
        return self._view

    def close(self) -> None:
        for e in self.engines.values():
            e.close()
        if self._view is not None:
            self._view.client.close()
        for n in self.nodes.values():
            n.close()
        self.master.close()


def running_cluster(tmp_path_factory: pytest.TempPathFactory, name: str = "cluster") -> Iterator[Cluster]:
    """A cluster as above, up until the generator is closed; skips where namespaces cannot
    be made. A fixture yields from it (`cluster` below; a module that needs a cluster in a
    known state, such as tests/cluster/test_frozen.py, has one of its own)."""
    why = netns.unavailable()
    if why:
        pytest.skip(f"simulated hosts unavailable: {why}")
    if not (MODEL_DIR / "model.safetensors").exists():
        pytest.skip("no trained model committed under bench/quality/")
    tmp = tmp_path_factory.mktemp(name)
    with netns.Network(("m", *NODES)) as net:
        c = Cluster(net, tmp)
        try:
            c.master.start()
            for host in NODES:
                c.nodes[host] = c.node(host).start()
            for host in NODES:
                c.engines[host] = Engine(net.prefix(host), tmp / f"engine-{host}.log")
            yield c
            summary = c.summary()  # docs/scale-out.md's table (pytest -s shows it; also beside the logs)
            (tmp / "summary.txt").write_text(summary + "\n")
            print("\n" + summary)
        finally:
            c.close()


@pytest.fixture(scope="package")
def cluster(tmp_path_factory):
    yield from running_cluster(tmp_path_factory)


def wait_for(what: str, ok, timeout: float, every: float = 0.1):
    """Poll `ok()` until truthy (returned) or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (got := ok()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f}s")
        time.sleep(every)
    return got
