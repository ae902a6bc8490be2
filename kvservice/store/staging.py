"""Staging areas of co-located Stores (StoreLocal, docs/storage.md "Co-located Store").

A staging area is shared memory the service makes for ONE Store: an anonymous memfd
(no name in any filesystem), sized to the payload and sealed against shrinking and
growing, so the client can write into it but can never truncate it under the
service's mapping (a truncated mapping would fault the service). The client opens it
as /proc/<service pid>/fd/<fd>, which only a process of the same host, pid namespace
and user can; the memfd's name carries the staging id, so a client checks it opened
this Store's area and not some other file. The area lives as long as the Store: closed
when the Store commits or fails, and with the process if the service dies (nothing is
left behind on disk or in /dev/shm to clean up).

The service reads the staged layers only after the client said they are staged, and
trusts nothing else the client says about them: checksums are computed here, from the
staged bytes (see session.StoreSession.add_layer), and the host-tier copy made from the
same bytes at commit is checked against them.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets

from kvcraft.layout import STAGING_NAME_PREFIX
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def supported() -> bool:
    """memfd with seals, and /proc to reach it: Linux."""
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and os.path.isdir("/proc/self/fd")


class StagingArea:
    """One Store's staging memory, mapped here; `close()` (idempotent) releases it."""

    def __init__(self, length: int) -> None:
        self.staging_id = secrets.token_hex(16)
        self.length = length
        self._fd = os.memfd_create(STAGING_NAME_PREFIX + self.staging_id, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self._fd, length)
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, _SEALS)
            self._map = mmap.mmap(self._fd, length)
        except BaseException:
            os.close(self._fd)
            raise
        self.view = memoryview(self._map)

    @property
    def path(self) -> str:
        return f"/proc/{os.getpid()}/fd/{self._fd}"

    def close(self) -> None:
        if self._fd < 0:
            return
        self.view.release()
        try:
            self._map.close()
        except BufferError:  # a layer view is still held somewhere: the mapping goes with it
            pass
        os.close(self._fd)
        self._fd = -1
