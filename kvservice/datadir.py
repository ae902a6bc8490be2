"""One service per data dir: who holds it, and the refusal every other process gets.

A service (and `kvcraft repair`) holds `<data_dir>/kvcraft.lock` with flock(LOCK_EX) from
before it opens anything in the data dir until it has closed everything; the kernel lets go
of the lock when the process ends, SIGKILL included, so a lock is never stale. The holder
writes its pid and command line into the file, and the kernel's own table of locks
(/proc/locks) names the process that holds it, so a refusal says which process is in the
way rather than what failed underneath (RocksDB's "While lock file" is not damage).

RocksDB keeps a lock of its own on `metadata/LOCK` (a POSIX record lock); a process that
holds the metadata without this file (an older build, another tool) is named from that
lock's entry in /proc/locks (`holder`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
import time
from pathlib import Path

LOCK_FILE = "kvcraft.lock"


class DataDirInUse(Exception):
    """Another live process holds the data dir. Nothing in it was opened or changed."""

    def __init__(self, data_dir: Path, holder: str) -> None:
        super().__init__(f"data dir {data_dir} is in use by {holder}: one service at a time may hold a data "
                         "dir. Stop that process first, or give this one another --data-dir. The data dir "
                         "is not damaged: do not run `kvcraft repair` on it while it is in use")
        self.data_dir = data_dir
        self.holder = holder


def _lock_table_pids(path: Path) -> list[int]:
    """Pids that /proc/locks says hold a lock on `path` (empty where that cannot be known:
    no /proc, or the holder is outside this pid namespace, where the kernel shows 0)."""
    try:
        st = path.stat()
        table = Path("/proc/locks").read_text()
    except OSError:
        return []
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in table.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 00:2a:5678 0 EOF" ("->" marks a waiter: not a holder)
        if len(fields) >= 6 and fields[1] != "->" and fields[5] == want and fields[4].isdigit():
            pid = int(fields[4])
            if pid > 0:
                pids.append(pid)
    return pids


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def holder(lock_path: Path, written: str = "") -> str:
    """Who holds `lock_path`, in words: the pid the kernel names, with its command line, else
    what the holder wrote into the file, else "another process" (the lock is all we know)."""
    pids = [p for p in _lock_table_pids(lock_path) if p != os.getpid()]
    if pids:
        cmd = _command(pids[0])
        return f"process {pids[0]}" + (f" ({cmd})" if cmd else "")
    if written:
        return written
    return "another process (its pid cannot be known from here: another pid namespace or no /proc)"


class DataDirLock:
    """The data dir's lock, held by this process until `release()`."""

    def __init__(self, data_dir: Path, fd: int) -> None:
        self.data_dir = data_dir
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, data_dir: Path, role: str = "kvcraft serve") -> "DataDirLock":
        """Take the data dir (made if missing) or raise DataDirInUse naming its holder."""
        data_dir = Path(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        path = data_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            written = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise DataDirInUse(data_dir, holder(path, _described(written))) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, (f"pid {os.getpid()} ({role}, started {time.strftime('%Y-%m-%d %H:%M:%S %z')}): "
                       f"{' '.join(sys.argv)}\n").encode(), 0)
        return cls(data_dir, fd)

    def lost(self) -> str:
        """Why this lock no longer keeps the data dir, "" while it does: the lock file (or
        the data dir) was removed or replaced under this process, so another process may
        lock the new file while this one still opens files by path in the new dir."""
        if self._fd is None:
            return ""
        path = self.data_dir / LOCK_FILE
        try:
            now = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return f"{path} was removed"
        except OSError:  # not known now (permissions changed, a stalled mount): asked again later
            return ""
        held = os.fstat(self._fd)
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            return f"{path} is no longer the file this process locked (the data dir was removed and made again)"
        return ""

    def release(self) -> None:
        """Let go (the file stays: removing it could let two processes lock two files)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _described(written: str) -> str:
    return f"{written.splitlines()[0]} (as it wrote in {LOCK_FILE})" if written else ""
