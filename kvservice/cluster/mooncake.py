"""Mooncake Store, as kvcraft uses it: the client wrapper.

`MooncakeClient` wraps `mooncake.store.MooncakeDistributedStore` (wheel
`mooncake-transfer-engine-non-cuda` on CPU machines, `mooncake-transfer-engine` with
CUDA; both need the system library libibverbs1 at import). It turns Mooncake's
integer error codes into the service's errors, and buffers into the addresses the
zero-copy calls take: objects are written from, and read into, the caller's memory
(`batch_put_from_multi_buffer_ranges`, `batch_get_into_multi_buffers`), never
through Python bytes.

Metadata: the clients find each other by P2P handshake ("P2PHANDSHAKE"), so a
cluster is one `mooncake_master` and the nodes; no etcd, no HTTP metadata server.

The master itself: `kvservice.cluster.master` (tests, benchmarks, a local try-out);
production runs it as its own service (deploy/compose.scale-out.yaml, docs/scale-out.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from kvservice.errors import Unavailable

# Mooncake error codes (mooncake-store/include/types.h) that mean "this object is not
# (or no longer) stored": the caller treats the variant as absent and recomputes.
_GONE = {-703, -704, -707, -710, -712}
OBJECT_ALREADY_EXISTS = -705
_RPC_FAILED = {-900, -901}  # RPC_FAIL, RPC_TIMEOUT: the master did not answer
WATCH_INTERVAL_S = 0.25
_PROBE_KEY = "kvcraft/probe"  # never stored: a lookup of it only asks the master

Buffer = bytes | bytearray | memoryview


class ObjectMissing(KeyError):
    """The object is not in the store (never written, evicted, or lost with the master)."""


@dataclass(frozen=True)
class RemoteSettings:
    """How a node joins a Mooncake Store cluster (Config's `remote_*` settings)."""

    master_address: str  # host:port of mooncake_master
    local_hostname: str = ""  # address other nodes reach this node's segment at ("": route_address)
    protocol: str = "tcp"  # tcp | rdma
    device: str = ""  # RDMA device names (rdma only), e.g. "mlx5_0"
    segment_bytes: int = 1 << 30  # host memory this node contributes to the cluster
    buffer_bytes: int = 64 << 20  # the client's own transfer buffer
    timeout_s: float = 2.0  # a transfer to a peer's segment without progress this long fails


PEER_PAUSE_MS = 10_000  # a peer whose transfer failed is not tried again for this long


def transfer_env(timeout_s: float) -> dict[str, str]:
    """The Mooncake transfer engine's timeouts (read once, when its extension loads): its
    TCP defaults wait 30 s for progress on a connection whose peer went silent (a cut
    link), and retry a failed peer at once."""
    t = str(max(1, math.ceil(timeout_s)))
    return {"MC_TCP_PROGRESS_TIMEOUT_SEC": t, "MC_TCP_STATUS_TIMEOUT_SEC": t, "MC_HANDSHAKE_CONNECT_TIMEOUT": t,
            "MC_TRANSFER_TIMEOUT": t, "MC_CONN_PAUSE_TTL_MS": str(PEER_PAUSE_MS)}


def _view(buf: Buffer) -> np.ndarray:
    """A uint8 array over `buf`'s memory (no copy), to take its address."""
    if isinstance(buf, memoryview) and buf.format != "B":
        buf = buf.cast("B")
    return np.frombuffer(buf, dtype=np.uint8)


class MooncakeClient:
    """One node's connection to the cluster; thread-safe (Mooncake's client is)."""

    def __init__(self, settings: RemoteSettings) -> None:
        self.settings = settings
        for k, v in transfer_env(settings.timeout_s).items():
            os.environ.setdefault(k, v)  # an operator's own MC_* setting wins
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise Unavailable(
                f"the remote tier needs Mooncake Store: pip install mooncake-transfer-engine-non-cuda "
                f"(CPU) or mooncake-transfer-engine (CUDA), and the system library libibverbs1 "
                f"(apt-get install libibverbs1); import failed: {e}") from None
        self._store = MooncakeDistributedStore()
        if not settings.local_hostname:
            settings = dataclasses.replace(settings, local_hostname=route_address(settings.master_address))
            self.settings = settings
        s = settings
        rc = self._store.setup(s.local_hostname, "P2PHANDSHAKE", s.segment_bytes, s.buffer_bytes,
                               s.protocol, s.device, s.master_address)
        if rc != 0:
            raise Unavailable(f"cannot join the Mooncake cluster at master {s.master_address} "
                              f"(setup returned {rc}); is mooncake_master running there?")
        self._closed = False
        self._lock = threading.Lock()
        # While the master is unreachable every Mooncake call blocks ~4 s before it
        # fails: a watcher keeps `up` current (TCP connect to the master every
        # WATCH_INTERVAL_S), and calls fail at once while it is down.
        self.up = True
        self.on_rejoin: list[Callable[[], None]] = []  # called (watcher thread) when the master answers again
        self._stop = threading.Event()
        self._master = _host_port(s.master_address)
        self._watcher = threading.Thread(target=self._watch, name="kvcraft-mooncake-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            try:
                socket.create_connection(self._master, timeout=WATCH_INTERVAL_S).close()
            except OSError:
                self.up = False
                continue
            if not self.up and self._answers():
                self.up = True
                for call in self.on_rejoin:
                    call()

    def _answers(self) -> bool:
        """Whether the master answers a call, not only a connection: after a restart the
        client's first call fails on the connection it kept to the master that died (end
        of file); this call takes that failure, so that the node is up, and rejoins, only
        once its calls reach the master again."""
        return self._store.batch_is_exist([_PROBE_KEY])[0] not in _RPC_FAILED

    def _need_up(self, what: str) -> None:
        if not self.up:
            raise Unavailable(f"remote tier: cannot {what}: the Mooncake master at {self.settings.master_address} "
                              "is unreachable")

    # -- payload objects (zero-copy) ------------------------------------------------------
    def begin_put(self, key: str, size: int) -> None:
        """Reserve an object of `size` bytes; fill it with `put_range`, then `end_put`."""
        self._need_up(f"write {key}")
        rc = self._store.batch_put_session_start([key], [size])[0]
        if rc == OBJECT_ALREADY_EXISTS:
            raise FileExistsError(key)
        self._check(rc, f"reserve {size} bytes for {key}")

    def put_range(self, key: str, offset: int, parts: Sequence[Buffer]) -> None:
        """Copy `parts`, back to back, into the reserved object at `offset`, straight
        from their memory."""
        self._need_up(f"write {key}")
        arrays = [_view(p) for p in parts]
        ptrs, sizes, offs = [], [], []
        at = offset
        for a in arrays:
            ptrs.append(a.ctypes.data)
            sizes.append(a.nbytes)
            offs.append(at)
            at += a.nbytes
        rc = self._store.batch_put_from_multi_buffer_ranges([key], [ptrs], [sizes], [offs])[0]
        if rc < 0:
            self._check(rc, f"write {at - offset} bytes into {key}")

    def end_put(self, key: str) -> None:
        self._need_up(f"complete {key}")
        self._check(self._store.batch_put_session_end([key])[0], f"complete {key}")

    def abort_put(self, key: str) -> None:
        if self.up:
            self._store.batch_put_session_revoke([key])

    def get_into(self, key: str, parts: Sequence[Buffer]) -> int:
        """Read the object into `parts` (writable, back to back); their sizes must add
        up to the object's. ObjectMissing if absent, Unavailable if the cluster is not
        reachable."""
        self._need_up(f"read {key}")
        arrays = [_view(p) for p in parts]
        rc = self._store.batch_get_into_multi_buffers(
            [key], [[a.ctypes.data for a in arrays]], [[a.nbytes for a in arrays]])[0]
        if rc < 0:
            self._check(rc, f"read {key}")
        return rc

    # -- small records --------------------------------------------------------------------
    def placement(self, key: str) -> str:
        """The transport endpoint (host:port) of the segment holding the object's replica
        ("" when absent)."""
        self._need_up(f"locate {key}")
        for r in self._store.get_replica_desc(key):
            if r.is_memory_replica():
                return r.get_memory_descriptor().buffer_descriptor.transport_endpoint
        return ""

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        """Values of small objects; b"" for an absent one (or when the master is down)."""
        if not keys or not self.up:
            return [b""] * len(keys)
        return self._store.get_batch(list(keys))

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each object is stored (a replica on a live segment); Unavailable when
        the master does not answer."""
        if not keys:
            return []
        self._need_up("look objects up")
        codes = self._store.batch_is_exist(list(keys))
        for rc in codes:
            if rc < 0 and rc not in _GONE:
                self._check(rc, f"look up {len(keys)} objects")
        return [rc == 1 for rc in codes]

    def create(self, key: str, value: bytes) -> bool:
        """Store a small object unless one exists under `key` (False then)."""
        self._need_up(f"write {key}")
        rc = self._store.put(key, value)
        if rc == OBJECT_ALREADY_EXISTS:
            return False
        self._check(rc, f"write {key}")
        return True

    def upsert(self, key: str, value: bytes) -> None:
        self._need_up(f"write {key}")
        self._check(self._store.upsert(key, value), f"write {key}")

    def remove(self, key: str) -> None:
        """Delete the object; absent is not an error."""
        self._need_up(f"remove {key}")
        rc = self._store.remove(key, True)
        if rc < 0 and rc not in _GONE:
            self._check(rc, f"remove {key}")

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._stop.set()
                self._store.close()

    def _check(self, rc: int, what: str) -> None:
        if rc >= 0:
            return
        if rc in _GONE:
            raise ObjectMissing(what)
        if rc in _RPC_FAILED:
            self.up = False  # until the watcher reaches the master again
        raise Unavailable(f"remote tier: cannot {what}: Mooncake error {rc}")


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def route_address(master_address: str) -> str:
    """The address this host sends from to reach `master_address`: on a cluster network,
    the one the other nodes reach it at (remote_local_hostname's default). Unavailable if
    no route leads there."""
    host, port = _host_port(master_address)
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)  # a datagram socket sends nothing: the kernel only picks the route
            return s.getsockname()[0]
    except OSError as e:
        raise Unavailable(f"no route to the Mooncake master at {master_address}: {e}") from None
