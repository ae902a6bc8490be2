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

The memory is the client's: the service allocates nothing for it, and unmaps it when the
Store commits or fails; if the service dies, nothing of it is left anywhere (the
client's area lives in the client; the Store's temporary payload file is deleted by
start-up recovery as for any Store).

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

from kvcraft.layout import STAGING_NAME_PREFIX
from kvservice.errors import FailedPrecondition, InvalidArgument

_ID = re.compile(r"[0-9a-f]{32}")


def supported() -> bool:
    """memfd seals and /proc to reach a client's descriptors: Linux."""
    return hasattr(fcntl, "F_GET_SEALS") and os.path.isdir("/proc/self/fd")


class StagingArea:
    """A client's staging area, mapped read-only here; `close()` (idempotent) unmaps it."""

    def __init__(self, staging_id: str, pid: int, fd: int, length: int) -> None:
        if not _ID.fullmatch(staging_id):
            raise InvalidArgument(f"staging.staging_id {staging_id[:40]!r} is not 32 lowercase hex chars")
        if pid < 1 or fd < 0:
            raise InvalidArgument(f"staging.pid {pid} / staging.fd {fd}: not a process's descriptor")
        self.staging_id = staging_id
        self.length = length
        path = f"/proc/{pid}/fd/{fd}"
        expected = f"/memfd:{STAGING_NAME_PREFIX}{staging_id} (deleted)"
        try:
            own = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise FailedPrecondition(f"cannot open the staging area {path}: {e.strerror} (not the same host, pid "
                                     "namespace or user: use the Store stream)") from None
        try:
            if os.readlink(f"/proc/self/fd/{own}") != expected:
                raise FailedPrecondition(f"{path} is not staging area {staging_id} (not the same host or pid "
                                         "namespace: use the Store stream)")
            try:
                seals = fcntl.fcntl(own, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if not seals & fcntl.F_SEAL_SHRINK:
                raise InvalidArgument(f"staging area {staging_id} is not sealed against shrinking (F_SEAL_SHRINK)")
            size = os.fstat(own).st_size
            if size < length:
                raise InvalidArgument(f"staging area {staging_id} has {size} bytes; the payload needs {length}")
            self._map = mmap.mmap(own, length, prot=mmap.PROT_READ)
        finally:
            os.close(own)
        self.view = memoryview(self._map)

    def close(self) -> None:
        if self._map is None:
            return
        self.view.release()
        try:
            self._map.close()
        except BufferError:  # a layer view is still held somewhere: the mapping goes with it
            pass
        self._map = None
