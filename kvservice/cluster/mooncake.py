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
import logging
import math
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from kvservice.cluster.silence import SilentSegments
from kvservice.cluster.watch import DOWN, DROPPED, REMOUNTING, UP, WATCH_INTERVAL_S, MasterWatch
from kvservice.errors import Unavailable

# Mooncake error codes (mooncake-store/include/types.h) that mean "this object is not
# (or no longer) stored": the caller treats the variant as absent and recomputes.
_GONE = {-703, -704, -707, -710, -712}
OBJECT_ALREADY_EXISTS = -705
_RPC_LOST = -900  # RPC_FAIL: the connection failed (a restarted master's end of file among others)
_RPC_FAILED = {_RPC_LOST, -901}  # and RPC_TIMEOUT: the master did not answer
RECONNECT_TRIES = 4
RECONNECT_PAUSE_S = 0.05  # pauses between the tries: 0, 0.05, 0.1 s
# A put session's start answers INVALID_PARAMS when this client still holds a session for
# the key (an end or revoke whose answer was lost); a revoke answers INVALID_WRITE when the
# master completed the put after all.
_SESSION_HELD = -600
_PUT_COMPLETE = -700
_PROBE_KEY = "kvcraft/probe"  # never stored: a lookup of it only asks the master
_MARK = "kvcraft/segment/"  # + a node's segment endpoint: its mark (kvservice.cluster.watch; probes read it)
SMALL_READS = 8  # reads of small objects in flight, one per segment read from

Buffer = bytes | bytearray | memoryview
log = logging.getLogger("kvcraft.cluster")


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


# The transfer engine's own pause of a peer whose transfer failed. Short: kvcraft skips a
# silent segment itself (kvservice.cluster.silence), and the probe that finds it answering
# again must reach it soon after.
PEER_PAUSE_MS = 1_000


def transfer_env(timeout_s: float) -> dict[str, str]:
    """The Mooncake transfer engine's timeouts (read once, when its extension loads): its
    TCP defaults wait 30 s for progress on a connection whose peer went silent (a cut
    link), and retry a failed peer at once."""
    t = str(max(1, math.ceil(timeout_s)))
    return {"MC_TCP_PROGRESS_TIMEOUT_SEC": t, "MC_TCP_STATUS_TIMEOUT_SEC": t, "MC_HANDSHAKE_CONNECT_TIMEOUT": t,
            "MC_TRANSFER_TIMEOUT": t, "MC_CONN_PAUSE_TTL_MS": str(PEER_PAUSE_MS)}


class _Guarded:
    """The Mooncake store, closed only once no call is inside it: a call into a closed
    store crashes the process, and calls run on several threads (a read given up on after
    its timeout goes on in the background)."""

    def __init__(self, store: object) -> None:
        self._store = store
        self._idle = threading.Condition()
        self._calls = 0
        self._closed = False

    def __getattr__(self, name: str) -> Callable:
        fn = getattr(self._store, name)

        def call(*args: object) -> object:
            with self._idle:
                if self._closed:
                    raise Unavailable("remote tier: the Mooncake client is closed")
                self._calls += 1
            try:
                return fn(*args)
            finally:
                with self._idle:
                    self._calls -= 1
                    self._idle.notify_all()

        return call

    def close(self, wait_s: float) -> bool:
        """Close once the calls inside have returned; False (left open) if one is still
        inside after `wait_s` (a frozen master or node holds it)."""
        with self._idle:
            self._closed = True
            if not self._idle.wait_for(lambda: self._calls == 0, timeout=wait_s):
                return False
        self._store.close()
        return True


def _view(buf: Buffer) -> np.ndarray:
    """A uint8 array over `buf`'s memory (no copy), to take its address."""
    if isinstance(buf, memoryview) and buf.format != "B":
        buf = buf.cast("B")
    return np.frombuffer(buf, dtype=np.uint8)


class MooncakeClient:
    """One node's connection to the cluster; thread-safe (Mooncake's client is).

    What this node writes goes to its own segment first (the master places it elsewhere
    when that one is full): a node that goes silent costs the other nodes what it wrote,
    not what a healthy node wrote. `watch` keeps `up` current and says when this node must
    put its variants back; `silent` holds the segments that stopped answering reads.
    """

    def __init__(self, settings: RemoteSettings) -> None:
        self.settings = settings
        for k, v in transfer_env(settings.timeout_s).items():
            os.environ.setdefault(k, v)  # an operator's own MC_* setting wins
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as e:
            raise Unavailable(
                f"the remote tier needs Mooncake Store: pip install mooncake-transfer-engine-non-cuda "
                f"(CPU) or mooncake-transfer-engine (CUDA), and the system library libibverbs1 "
                f"(apt-get install libibverbs1); import failed: {e}") from None
        self._store = _Guarded(MooncakeDistributedStore())
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
        self.up = True  # the master answers (kept by `watch`; calls fail at once while it is False)
        self._own = ReplicateConfig()
        self._pinned = ReplicateConfig()
        if s.segment_bytes:
            self._own.preferred_segment = self._pinned.preferred_segment = self._store.get_hostname()
        self._pinned.with_hard_pin = True  # the mark: never evicted, gone only with the segment
        self._unsettled: set[str] = set()  # put sessions whose end or revoke got no answer
        self._small_reads = ThreadPoolExecutor(SMALL_READS, thread_name_prefix="kvcraft-small-read")
        self.silent = SilentSegments(self._marked_at, self._answers_at)
        try:
            self.endpoint = self._find_endpoint() if s.segment_bytes else ""
            if self.endpoint and not self.mark():
                raise Unavailable(f"the Mooncake master at {s.master_address} placed this node's mark outside its "
                                  "own segment, just mounted: the other nodes could not probe the segment, nor "
                                  "this node tell when the master drops it")
        except BaseException:
            self.silent.close()
            self._small_reads.shutdown()
            self._store.close(wait_s=0)
            raise
        # called (watcher thread) when this node must put its variants back: the master
        # answers again after it did not, or it dropped this node's segment
        self.on_rejoin: list[Callable[[], None]] = []
        self.watch = MasterWatch(self, s.timeout_s)

    # -- this node's segment and the master ------------------------------------------------
    def _find_endpoint(self) -> str:
        """The transfer endpoint of this node's own segment: where the master says an object
        put there lies."""
        key = f"{_MARK}new/{self._store.get_hostname()}"
        try:
            self._check(self._store.put(key, b"\x01", self._own), "place an object in this node's own segment")
            return self._where(key)
        finally:
            self._store.remove(key, True)

    @property
    def master_address(self) -> str:
        return self.settings.master_address

    @property
    def mark_key(self) -> str:
        return f"{_MARK}{self.endpoint}" if self.endpoint else ""

    def mark(self) -> bool:
        """Put this node's mark into its own segment; False while the master places it
        elsewhere (the segment is not mounted again yet, after the master dropped it)."""
        self._store.put(self.mark_key, b"\x01", self._pinned)
        if self._where(self.mark_key) == self.endpoint:
            return True
        self._store.remove(self.mark_key, True)
        return False

    def check(self) -> str:
        """UP; DOWN (the master does not answer); DROPPED (it answers but no longer held
        this node's mark: it dropped the segment, or restarted empty; marked again now) or
        REMOUNTING (dropped, and the segment is not mounted again yet)."""
        rc = self._is_exist([self.mark_key or _PROBE_KEY])[0]
        if rc < 0 and rc not in _GONE:
            return DOWN
        if not self.mark_key or rc == 1:
            return UP
        return DROPPED if self.mark() else REMOUNTING

    def connects(self) -> bool:
        """Whether a TCP connection to the master's address opens (a cut link fails it)."""
        try:
            socket.create_connection(_host_port(self.settings.master_address), timeout=WATCH_INTERVAL_S).close()
            return True
        except OSError:
            return False

    def _marked_at(self, endpoint: str) -> bool | None:
        """Whether the master holds the mark of the segment at `endpoint` (None: it did not
        answer)."""
        rc = self._is_exist([f"{_MARK}{endpoint}"])[0]
        return None if rc < 0 and rc not in _GONE else rc == 1

    def _answers_at(self, endpoint: str) -> bool:
        """Whether a read of the mark of the segment at `endpoint` returns it (waits on a
        node that does not answer)."""
        return bool(self._store.get_batch([f"{_MARK}{endpoint}"])[0])

    def _is_exist(self, keys: Sequence[str]) -> list[int]:
        """batch_is_exist's codes. Calls on the connection the client kept to a master that
        restarted fail (end of file) until the client has connected again: such a call is
        made again, RECONNECT_TRIES times in all, before it counts as the master's silence."""
        codes = self._store.batch_is_exist(list(keys))
        for attempt in range(1, RECONNECT_TRIES):
            if _RPC_LOST not in codes:
                break
            time.sleep(RECONNECT_PAUSE_S * (attempt - 1))
            codes = self._store.batch_is_exist(list(keys))
        return codes

    def _need_up(self, what: str) -> None:
        if not self.up:
            raise Unavailable(f"remote tier: cannot {what}: the Mooncake master at {self.settings.master_address} "
                              "is unreachable")

    # -- payload objects (zero-copy) ------------------------------------------------------
    def begin_put(self, key: str, size: int) -> None:
        """Reserve an object of `size` bytes in this node's segment; fill it with
        `put_range`, then `end_put`. FileExistsError if the object exists (complete or being
        written)."""
        self._need_up(f"write {key}")
        if key in self._unsettled:
            self._settle([key])
        rc = self._store.batch_put_session_start([key], [size], self._own)[0]
        if rc == _SESSION_HELD:  # a session of this client whose end or revoke was lost
            self._settle([key])
            rc = self._store.batch_put_session_start([key], [size], self._own)[0]
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
        rc = self._store.batch_put_session_end([key])[0]
        if rc in _RPC_FAILED:  # the master may have completed it all the same: settled later
            self._unsettled.add(key)
        self._check(rc, f"complete {key}")

    def abort_put(self, key: str) -> None:
        """Give the reserved object up. Where the master does not answer, the session is
        settled later (`settle`, and before the key is written again): a session left open
        would refuse every later write of the key."""
        self._unsettled.add(key)
        if self.up:
            self._settle([key])

    def _settle(self, keys: Sequence[str]) -> None:
        keys = list(keys)
        codes = self._store.batch_put_session_revoke(keys)
        complete = [k for k, rc in zip(keys, codes) if rc == _PUT_COMPLETE]
        ended = dict(zip(complete, self._store.batch_put_session_end(complete))) if complete else {}
        for k, rc in zip(keys, codes):
            # 0: revoked; _SESSION_HELD: this client holds no session for the key (any more)
            if rc in (0, _SESSION_HELD) or ended.get(k) == 0:
                self._unsettled.discard(k)

    def settle(self) -> None:
        """Revoke (or complete, where the master did) the put sessions whose end or revoke
        got no answer: once the master answers again."""
        if self._unsettled:
            self._settle(sorted(self._unsettled))

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
        return self._where(key)

    def _where(self, key: str) -> str:
        for r in self._store.get_replica_desc(key):
            if r.is_memory_replica():
                return r.get_memory_descriptor().buffer_descriptor.transport_endpoint
        return ""

    def placements(self, keys: Sequence[str]) -> dict[str, str]:
        """key -> the endpoint of the segment holding it, for those of `keys` that are
        stored (ask only for stored ones: Mooncake logs an error for each absent key)."""
        if not keys:
            return {}
        self._need_up(f"locate {len(keys)} objects")
        out = {}
        for key, replicas in self._store.batch_get_replica_desc(list(keys)).items():
            for r in replicas:
                if r.is_memory_replica():
                    out[key] = r.get_memory_descriptor().buffer_descriptor.transport_endpoint
                    break
        return out

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        """Values of small objects; b"" for an absent one (or when the master is down)."""
        if not keys or not self.up:
            return [b""] * len(keys)
        return self._store.get_batch(list(keys))

    def read_small(self, keys: Sequence[str], timeout: float) -> tuple[dict[str, bytes], set[str]]:
        """The values of the stored small objects among `keys`, read at once, one call per
        segment holding some; and the keys left unread because their segment is silent. A
        segment that does not answer within `timeout` becomes silent (`silent`).
        Unavailable when the master does not answer."""
        keys = [k for k, there in zip(keys, self.exists(keys)) if there]
        by_segment: dict[str, list[str]] = {}
        for key, endpoint in self.placements(keys).items():
            by_segment.setdefault(endpoint, []).append(key)
        skipped = {k for e, ks in by_segment.items() if e in self.silent for k in ks}
        reads = {e: self._small_reads.submit(self._store.get_batch, ks)
                 for e, ks in by_segment.items() if e not in self.silent}
        done, _ = wait(reads.values(), timeout=timeout)
        out: dict[str, bytes] = {}
        for endpoint, read in reads.items():
            if read not in done:
                self.silent.add(endpoint, f"no answer within {timeout:.1f}s to a read of "
                                          f"{len(by_segment[endpoint])} small objects")
                skipped.update(by_segment[endpoint])
                continue
            out.update((k, v) for k, v in zip(by_segment[endpoint], read.result()) if v)
        return out, skipped

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each object is stored (a replica on a live segment); Unavailable when
        the master does not answer."""
        if not keys:
            return []
        self._need_up("look objects up")
        codes = self._is_exist(keys)
        for rc in codes:
            if rc < 0 and rc not in _GONE:
                self._check(rc, f"look up {len(keys)} objects")
        return [rc == 1 for rc in codes]

    def create(self, key: str, value: bytes) -> bool:
        """Store a small object in this node's segment unless one exists under `key`
        (False then)."""
        self._need_up(f"write {key}")
        rc = self._store.put(key, value, self._own)
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
                self.watch.close()
                self.silent.close()
                self._small_reads.shutdown(wait=False, cancel_futures=True)  # a read stuck on a frozen node
                if not self._store.close(wait_s=2 * self.settings.timeout_s + 1):
                    log.warning("a cluster call is still waiting on a node or master that does not answer: the "
                                "Mooncake client is left open (the master drops it after its client_ttl)")

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
