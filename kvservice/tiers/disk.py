"""Disk tier: one file per variant, written so that a crash never leaves a file that
looks complete but is not (docs/storage.md, "Disk format" and "Write order").

Layout: <root>/<vid[:2]>/<vid>.kv holds, for each layer in order, K bytes then V bytes,
then the variant's record (a serialized kvcraft.v1.VariantInfo, as committed to the
metadata), its length (u32, little-endian) and the 8 bytes RECORD_MAGIC. The record
makes a payload file self-describing: `kvcraft repair` rebuilds lost metadata from it,
and recovery adopts a complete payload whose record was lost instead of deleting it.
A write goes to <vid>.<random>.kv.tmp, is fsynced, renamed into place and the directory
fsynced; only then may the store commit metadata. Leftover .tmp files are crash debris.

This is the POSIX backend, used where CUDA is absent. On CUDA machines kvikio reads
straight into GPU memory; that backend is not built yet (no GPU in this environment).
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import secrets
import struct
import threading
from pathlib import Path
from typing import Iterator

from kvcraft import tiers
from kvservice.tiers.base import Buffer, PayloadShape, Tier, TierFull, TierWriter

SUFFIX = ".kv"
TMP_SUFFIX = ".kv.tmp"
log = logging.getLogger("kvcraft.disk")
RECORD_MAGIC = b"KVCRREC1"
_TRAILER = struct.Struct("<I8s")  # record length, magic
# A writer asks the kernel to start writing its file back every this many bytes, so
# the disk works while the stream goes on and commit's fsync waits only for the tail.
WRITEBACK_BYTES = 4 << 20
# Page-cache writes of at most this many bytes each. Linux (6.x, large folios) sizes the
# page-cache folios of a write by the write's length: a 2 MiB write gets 2 MiB folios. On
# a VM that hands free memory back to its host (virtio-balloon free page reporting, in
# 2 MiB blocks: page_reporting_order 9), such a folio is memory the host took back and
# must fault in again page by page. On such a VM 1 MiB writes were several times faster
# than 2 and 4 MiB ones (docs/benchmarks.md, "Store and the page cache"); elsewhere smaller
# writes cost one more syscall per MiB.
WRITE_BYTES = 1 << 20


def _sync_file_range():  # noqa: ANN202 - libc's sync_file_range, or None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux: commit's fsync does all the work
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait


class DiskWriter(TierWriter):
    """Streams one variant's payload into a temporary file; `commit` makes it durable."""

    reads_back = True  # while commit's fsync runs

    def __init__(self, tier: "DiskTier", variant_id: str, shape: PayloadShape) -> None:
        self._tier = tier
        self._shape = shape
        self.final = tier.path_of(variant_id)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        # A unique temporary name: two streams storing the same variant never collide.
        self.tmp = self.final.with_name(f"{variant_id}.{secrets.token_hex(4)}{TMP_SUFFIX}")
        self._fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._reserved = shape.total_bytes
        self.written = 0
        self._written_back = 0  # bytes handed to the kernel's writeback (sync_file_range)
        self._read_fd = -1  # read_back's descriptor (of the temporary file; survives the rename)
        self.record = b""  # appended after the layers at commit (self-describing file)

    def describe(self, record: bytes) -> None:
        """The variant's serialized record, written after the layers by `commit`."""
        self.record = record

    def write_layer(self, *parts: Buffer) -> None:
        for part in parts:  # K and V go out as they are, without being joined
            self.written += write_all(self._fd, part)
        if _SYNC_FILE_RANGE is not None and self.written - self._written_back >= WRITEBACK_BYTES:
            # ctypes releases the GIL; a failure here only leaves the work to commit's fsync
            _SYNC_FILE_RANGE(self._fd, self._written_back, self.written - self._written_back, _SYNC_FILE_RANGE_WRITE)
            self._written_back = self.written

    def open_reader(self) -> None:
        """Open the file for `read_back` (before `commit` renames it: the descriptor
        follows the file)."""
        if self._read_fd < 0:
            self._read_fd = os.open(self.tmp, os.O_RDONLY)

    def read_back(self, offset: int, into: memoryview) -> None:
        """Read back bytes written so far, from `offset`, straight into `into`. After
        `open_reader`; callable while `commit` runs in another thread, until
        `close_reader`. The bytes may come from the page cache or from the disk: a
        page evicted meanwhile is read again, by this read or by the kernel's
        readahead for an earlier one, so the caller checks them."""
        _pread_into(self._read_fd, into.cast("B"), offset, self.final.name)

    def close_reader(self) -> None:
        if self._read_fd >= 0:
            os.close(self._read_fd)
            self._read_fd = -1

    def commit(self) -> None:
        """fsync the file, rename it into place, fsync the directory."""
        if self.written != self._shape.total_bytes:
            raise ValueError(f"{self.final.name}: {self.written} bytes written, {self._shape.total_bytes} expected")
        try:
            if self.record:
                write_all(self._fd, self.record + _TRAILER.pack(len(self.record), RECORD_MAGIC))
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1
        os.replace(self.tmp, self.final)
        _fsync_dir(self.final.parent)
        self._tier._settle(self._reserved, self.written, add=self.final.name[: -len(SUFFIX)])
        self._reserved = 0

    def abort(self) -> None:
        self.close_reader()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self.tmp.unlink(missing_ok=True)
        if self._reserved:
            self._tier._settle(self._reserved, 0)
            self._reserved = 0


class DiskTier(Tier):
    name = tiers.DISK
    persistent = True
    verify_reads = True  # a file may rot or be damaged while we are not looking

    def __init__(self, root: Path, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._used = 0
        self._reserved = 0  # bytes of writers still streaming
        self._held: set[str] = set()  # variant ids with a committed file (no stat per question)
        self._lock = threading.Lock()
        # Files deleted but not yet unlinked (see `delete`), and the thread unlinking them.
        self._doomed: queue.SimpleQueue[Path | threading.Event | None] = queue.SimpleQueue()
        self._reaper = threading.Thread(target=self._reap, name="kvcraft-disk-reaper", daemon=True)
        self._reaper.start()

    def path_of(self, variant_id: str) -> Path:
        return self.root / variant_id[:2] / (variant_id + SUFFIX)

    def open_writer(self, variant_id: str, shape: PayloadShape) -> DiskWriter:
        with self._lock:
            n = shape.total_bytes
            if self._used + self._reserved + n > self.budget_bytes:
                raise TierFull(f"disk tier is full: budget {self.budget_bytes} bytes, {self._used} used, "
                               f"{self._reserved} reserved, {n} requested")
            self._reserved += n
        try:
            return DiskWriter(self, variant_id, shape)
        except BaseException:
            self._settle(n, 0)
            raise

    def get_layer(self, variant_id: str, layer: int, shape: PayloadShape) -> memoryview:
        return self._read(variant_id, shape.offset(layer), shape.layer_bytes)

    def get_layers(self, variant_id: str, first: int, count: int, shape: PayloadShape) -> memoryview:
        return self._read(variant_id, shape.offset(first), count * shape.layer_bytes)

    def read_layer_into(self, variant_id: str, layer: int, shape: PayloadShape, into: memoryview) -> None:
        """One pread from the file straight into `into` (a promotion: the host slab's room)."""
        self._read_into(variant_id, shape.offset(layer), into)

    def _read(self, variant_id: str, offset: int, length: int) -> memoryview:
        view = memoryview(bytearray(length))
        self._read_into(variant_id, offset, view)
        return view

    def _read_into(self, variant_id: str, offset: int, into: memoryview) -> None:
        """Bytes [offset, offset + len(into)) of the payload, straight into `into`.
        KeyError if absent."""
        try:
            fd = os.open(self.path_of(variant_id), os.O_RDONLY)
        except FileNotFoundError:
            raise KeyError(variant_id) from None
        try:
            _pread_into(fd, into, offset, variant_id)
        finally:
            os.close(fd)

    def delete(self, variant_id: str) -> None:
        """The file is renamed aside (to a crash-debris name, which recovery deletes) and
        unlinked by the reaper thread. The caller holds the store's lock, and unlinking a
        file just written takes the kernel time to drop its page cache and free its
        extents, tens of milliseconds for a large payload held under that lock; a rename
        is a metadata operation (docs/storage.md, `kvcraft bench eviction`). Its bytes
        leave `usage` at once."""
        path = self.path_of(variant_id)
        size = 0
        try:
            size = _payload_size(path)  # usage counts layer bytes, as commit and recovery do
            doomed = path.with_name(f"{variant_id}.{secrets.token_hex(4)}{TMP_SUFFIX}")
            os.rename(path, doomed)
        except FileNotFoundError:
            self._settle(0, 0, drop=variant_id)
            return
        except OSError as e:  # a read-only disk, no descriptor left: the variant's record is gone all the same
            log.warning("the payload of deleted variant %s stays on disk (%s): a start that finds it adopts the "
                        "variant back (it carries its record)", variant_id, e)
            self._settle(0, -size, drop=variant_id)  # (a Store of it again writes over the file)
            return
        self._doomed.put(doomed)
        self._settle(0, -size, drop=variant_id)

    def wait_deletes(self) -> None:
        """Return once every file deleted before the call is unlinked (the reaper takes
        them in order): for a caller that must see the directory as the deletes leave it."""
        reached = threading.Event()
        self._doomed.put(reached)
        reached.wait()

    def _reap(self) -> None:
        while (doomed := self._doomed.get()) is not None:
            if isinstance(doomed, threading.Event):
                doomed.set()
                continue
            try:
                doomed.unlink(missing_ok=True)
            except OSError as e:  # left for recovery, which deletes such debris at start
                log.warning("could not delete %s: %s", doomed, e)

    def close(self) -> None:
        """Unlink what is still waiting, then stop the reaper."""
        self._doomed.put(None)
        self._reaper.join()

    def usage(self) -> int:
        return self._used

    def __contains__(self, variant_id: object) -> bool:
        return variant_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def variant_ids(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def _settle(self, reserved: int, used: int, add: str = "", drop: str = "") -> None:
        with self._lock:
            self._reserved -= reserved
            self._used += used
            if add:
                self._held.add(add)
            self._held.discard(drop)

    # -- recovery ---------------------------------------------------------------------
    def scan(self) -> Iterator[tuple[str, int]]:
        """(variant id, size) of every complete payload file; deletes .tmp debris."""
        for sub in sorted(self.root.iterdir()) if self.root.exists() else ():
            if not sub.is_dir():
                continue
            for f in sorted(sub.iterdir()):
                if f.name.endswith(TMP_SUFFIX):
                    f.unlink(missing_ok=True)
                elif f.name.endswith(SUFFIX):
                    vid = f.name[: -len(SUFFIX)]
                    self._held.add(vid)
                    yield vid, _payload_size(f)

    def read_record(self, variant_id: str) -> bytes | None:
        """The record a payload file carries after its layers; None if it has none."""
        path = self.path_of(variant_id)
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                n = _record_length(fh, size)
                if n is None:
                    return None
                fh.seek(size - _TRAILER.size - n)
                return fh.read(n)
        except FileNotFoundError:
            return None

    def reset_usage(self, used: int) -> None:
        with self._lock:
            self._used = used


def _record_length(fh, size: int) -> int | None:  # noqa: ANN001 - a binary file
    if size < _TRAILER.size:
        return None
    fh.seek(size - _TRAILER.size)
    n, magic = _TRAILER.unpack(fh.read(_TRAILER.size))
    return n if magic == RECORD_MAGIC and n <= size - _TRAILER.size else None


def _payload_size(path: Path) -> int:
    """Bytes of layers in a payload file (its size without the record trailer)."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        n = _record_length(fh, size)
    return size if n is None else size - _TRAILER.size - n


def _pread_into(fd: int, into: memoryview, offset: int, what: str) -> None:
    into = into.cast("B")
    got, length = 0, into.nbytes
    while got < length:
        n = os.preadv(fd, [into[got:]], offset + got)
        if n == 0:
            raise OSError(f"{what}: payload file ends at {offset + got}, expected {offset + length}")
        got += n


def write_all(fd: int, data: Buffer) -> int:
    """Write every byte of `data` at the descriptor's offset, in writes of at most
    WRITE_BYTES (a short write is resumed); returns the byte count."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), WRITE_BYTES):
        piece = view[start : start + WRITE_BYTES]
        while piece:
            piece = piece[os.write(fd, piece) :]
    return len(view)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
