"""Staging areas of co-located Stores (StoreLocal, docs/storage.md "Co-located Store").

A co-located client keeps its own staging area: an anonymous memfd (in no filesystem)
named kvcraft-stage-<random id>, sealed against shrinking. For each Store it copies the
layers in and names the area (its pid, the fd, the id); the service opens it as
/proc/<pid>/fd/<fd>, which works only on the same host, in the same pid namespace and
with the right to read that process's descriptors (the same user), and maps it
READ-ONLY for the Store's life. Before mapping it checks that what it opened is that
memfd (the name with the id, so a client cannot make the service read any other file),
that it is sealed against shrinking (a truncated mapping would fault the service) and
long enough. Anything else: FAILED_PRECONDITION, and the client uses the gRPC stream.

The memory is the client's: the service allocates nothing for it. A failed Store unmaps
its area at once; after a committed one the mapping is kept (`StagingMaps`, at most
MAX_IDLE_MAPS, each dropped IDLE_S after its last Store) because the client's next Store
names the same area, and mapping it afresh costs a page fault per 4 KiB on the first
read (measured: most of a Store's time in the service). A kept mapping is used again
only if /proc/<pid>/fd/<fd> still names the same memfd. If the service dies, nothing of
it is left anywhere (the client's area lives in the client; the Store's temporary
payload file is deleted by start-up recovery as for any Store).

The service reads the staged layers only after the client said they are staged, and
trusts nothing else the client says about them: checksums are computed here, from the
staged bytes (session.StoreSession.add_layer), and the host-tier copy made from the same
bytes at commit is checked against them.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import threading
import time

from kvcraft.layout import STAGING_NAME_PREFIX
from kvservice.errors import FailedPrecondition, InvalidArgument

_ID = re.compile(r"[0-9a-f]{32}")
MAX_IDLE_MAPS = 16  # mappings of clients' areas kept between their Stores
IDLE_S = 2.0  # a kept mapping unused this long is dropped


def supported() -> bool:
    """memfd seals and /proc to reach a client's descriptors: Linux."""
    return hasattr(fcntl, "F_GET_SEALS") and os.path.isdir("/proc/self/fd")


class StagingArea:
    """A client's staging area, mapped read-only here (all of it, so a later, larger
    Store of the same client fits); `close()` (idempotent) unmaps it."""

    def __init__(self, staging_id: str, pid: int, fd: int) -> None:
        if not _ID.fullmatch(staging_id):
            raise InvalidArgument(f"staging.staging_id {staging_id[:40]!r} is not 32 lowercase hex chars")
        if pid < 1 or fd < 0:
            raise InvalidArgument(f"staging.pid {pid} / staging.fd {fd}: not a process's descriptor")
        self.key = (staging_id, pid, fd)
        self.staging_id = staging_id
        self.path = f"/proc/{pid}/fd/{fd}"
        self.expected = f"/memfd:{STAGING_NAME_PREFIX}{staging_id} (deleted)"
        try:
            own = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise FailedPrecondition(f"cannot open the staging area {self.path}: {e.strerror} (not the same host, "
                                     "pid namespace or user: use the Store stream)") from None
        try:
            if os.readlink(f"/proc/self/fd/{own}") != self.expected:
                raise FailedPrecondition(f"{self.path} is not staging area {staging_id} (not the same host or pid "
                                         "namespace: use the Store stream)")
            try:
                seals = fcntl.fcntl(own, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if not seals & fcntl.F_SEAL_SHRINK:
                raise InvalidArgument(f"staging area {staging_id} is not sealed against shrinking (F_SEAL_SHRINK)")
            self.length = os.fstat(own).st_size
            if self.length < 1:
                raise InvalidArgument(f"staging area {staging_id} is empty")
            self._map = mmap.mmap(own, self.length, prot=mmap.PROT_READ)
        finally:
            os.close(own)
        self.view = memoryview(self._map)
        self.last_used = time.monotonic()

    def check_length(self, length: int) -> None:
        if self.length < length:
            raise InvalidArgument(f"staging area {self.staging_id} has {self.length} bytes; the payload needs {length}")

    def still_there(self) -> bool:
        """The client still has this area open at the same descriptor."""
        try:
            return os.readlink(self.path) == self.expected
        except OSError:
            return False

    def close(self) -> None:
        if self._map is None:
            return
        self.view.release()
        try:
            self._map.close()
        except BufferError:  # a layer view is still held somewhere: the mapping goes with it
            pass
        self._map = None


class StagingMaps:
    """The mappings of clients' staging areas: one per Store running, and those kept
    between a client's Stores (see the module docstring)."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int, int], StagingArea] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._sweeper: threading.Thread | None = None
        self._closed = False

    def open(self, staging_id: str, pid: int, fd: int, length: int) -> StagingArea:
        with self._lock:
            area = self._idle.pop((staging_id, pid, fd), None)
        if area is not None and not area.still_there():
            area.close()
            area = None
        if area is None:
            area = StagingArea(staging_id, pid, fd)
        try:
            area.check_length(length)
        except BaseException:
            area.close()
            raise
        return area

    def release(self, area: StagingArea, keep: bool) -> None:
        """The Store using `area` ended; `keep`: it committed (the client will name the
        area again), else the mapping is dropped now."""
        if not keep:
            area.close()
            return
        area.last_used = time.monotonic()
        with self._lock:
            if self._closed:
                evicted = [area]
            else:
                old = self._idle.pop(area.key, None)  # a second Store of the same area
                evicted = [old] if old is not None else []
                self._idle[area.key] = area
                while len(self._idle) > MAX_IDLE_MAPS:
                    evicted.append(self._idle.pop(next(iter(self._idle))))  # the least recently kept
                if self._sweeper is None:
                    self._sweeper = threading.Thread(target=self._sweep, name="kvcraft-staging-sweep", daemon=True)
                    self._sweeper.start()
        for a in evicted:
            a.close()

    def held(self) -> int:
        with self._lock:
            return len(self._idle)

    def _sweep(self) -> None:
        while not self._wake.wait(IDLE_S / 2):
            now = time.monotonic()
            with self._lock:
                old = [k for k, a in self._idle.items() if now - a.last_used >= IDLE_S]
                expired = [self._idle.pop(k) for k in old]
            for a in expired:
                a.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = list(self._idle.values()), {}
        self._wake.set()
        for a in idle:
            a.close()
