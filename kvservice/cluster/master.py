"""`mooncake_master` in a process of its own: tests, benchmarks, a local try-out.

`MasterProcess` runs it bound to one address (127.0.0.1 unless told) on free ports;
production runs the master as its own service (deploy/compose.scale-out.yaml,
docs/scale-out.md).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from kvservice.launcher import ChildProcess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_binary() -> str:
    """The mooncake_master the wheel ships (in the package folder and on PATH)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        p = Path(list(spec.submodule_search_locations)[0]) / "mooncake_master"
        if p.exists():
            return str(p)
    found = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    if not os.path.exists(found):
        raise FileNotFoundError("mooncake_master not found: pip install mooncake-transfer-engine-non-cuda")
    return found


class MasterProcess(ChildProcess):
    """`mooncake_master` bound to `host` (127.0.0.1 unless told) on free ports, in its
    own process (in a network namespace of its own when `prefix` says so).

    Its RPC and admin/metrics servers listen on that address only; the HTTP metadata
    server is off (clients use P2P handshake). `restart` keeps the RPC port, so the
    nodes reconnect to the same address.
    """

    what = "mooncake_master"

    def __init__(self, log_path: Path, *, eviction_high_watermark: float = 0.9, host: str = "127.0.0.1",
                 prefix: Sequence[str] = (), client_ttl_s: int = 10) -> None:
        super().__init__(log_path, prefix)
        self.host = host  # the address it binds (and nodes reach it at)
        self.client_ttl_s = client_ttl_s  # a node silent this long is gone, with its segment's objects
        self.rpc_port = free_port()
        self.metrics_port = free_port()
        self.watermark = eviction_high_watermark

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    def start(self, timeout: float = 30.0) -> "MasterProcess":
        def ready() -> bool:
            try:
                socket.create_connection((self.host, self.rpc_port), 0.2).close()
                return True
            except OSError:
                time.sleep(0.02)
                return False

        self._launch(
            [master_binary(), f"-rpc_address={self.host}", f"-rpc_port={self.rpc_port}",
             f"-metrics_host={self.host}", f"-metrics_port={self.metrics_port}",
             "-enable_metric_reporting=false", "-enable_http_metadata_server=false",
             f"-eviction_high_watermark_ratio={self.watermark}", f"-client_ttl={self.client_ttl_s}",
             "-rpc_thread_num=2", "-logtostderr"],
            ready, timeout, stdout=self._log_file(), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self
