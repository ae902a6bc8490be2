"""How the disk tier reads a payload straight into GPU memory (docs/gpu.md).

Two backends, one method: `read_into_device(path, offset, length, dst)` puts bytes
[offset, offset + length) of a payload file into device memory at `dst` and returns the
skew (where in `dst` the first requested byte landed).

- `PosixBackend` (the default, and the fallback): pread into host memory, then one
  host-to-device copy. Works wherever a CUDA driver does.
- `KvikioBackend`: `kvikio.CuFile(path).pread(...)`, DMA from the drive into GPU memory
  when GPUDirect Storage is installed, kvikio's own compat mode (POSIX reads through a
  bounce buffer inside kvikio) where it is not. kvikio is imported only here, only when
  asked for, and is an optional extra (`pip install 'kvcraft[gpu]'`).

GDS moves whole 4 KiB pages: every file offset and size handed to kvikio is a multiple
of ALIGN, and so is the device address. The requested span is widened to the 4 KiB
pages that cover it (`aligned_window`); the widened head lands in `dst` before the skew.
A payload file rarely ends on a page boundary, so the last partial page (fewer than
4096 bytes, never more) is read with POSIX and copied up; kvikio never reads past EOF.

Reads into host memory (FetchLayers, promotion into the host slab) stay on the disk
tier's plain POSIX path: kvikio with a host buffer is a POSIX read too, and it needs a
CUDA driver even then.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Protocol

from kvservice.tiers import gpu_driver
from kvservice.tiers.gpu_driver import DeviceBuffer, Driver

log = logging.getLogger("kvcraft.disk")

ALIGN = 4096
BACKENDS = ("posix", "kvikio")


def align_down(n: int) -> int:
    return n // ALIGN * ALIGN


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def aligned_window(offset: int, length: int) -> tuple[int, int]:
    """(start, size): the whole 4 KiB pages covering [offset, offset + length)."""
    start = align_down(offset)
    return start, align_up(offset + length) - start


class DiskBackend(Protocol):
    name: str

    def read_into_device(self, path: Path, offset: int, length: int, dst: DeviceBuffer) -> int:
        """Bytes [offset, offset+length) of `path` into `dst`; returns the skew: the
        bytes sit at dst.ptr + skew. `dst` must hold `aligned_window(...)[1]` bytes and
        start on a 4 KiB boundary. OSError if the file is missing or too short."""
        ...


def _pread_exact(path: Path, offset: int, length: int) -> bytearray:
    buf = bytearray(length)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = 0
        while got < length:
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                raise OSError(f"{path}: file ends at {offset + got}, expected {offset + length} bytes")
            got += n
    finally:
        os.close(fd)
    return buf


def _check_dst(offset: int, length: int, dst: DeviceBuffer) -> tuple[int, int]:
    start, size = aligned_window(offset, length)
    if dst.ptr % ALIGN:
        raise ValueError(f"device buffer at {dst.ptr:#x} is not {ALIGN}-byte aligned")
    if dst.nbytes < size:
        raise ValueError(f"device buffer holds {dst.nbytes} bytes; the aligned window needs {size}")
    return start, size


class PosixBackend:
    name = "posix"

    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    def read_into_device(self, path: Path, offset: int, length: int, dst: DeviceBuffer) -> int:
        start, _ = _check_dst(offset, length, dst)
        skew = offset - start
        self.driver.htod(dst.ptr + skew, _pread_exact(path, offset, length))
        return skew


class KvikioBackend:
    name = "kvikio"

    def __init__(self, kvikio: Any, driver: Driver) -> None:
        self._kvikio = kvikio
        self.driver = driver
        # True where cuFile cannot run (no GDS driver, in a container without /run/udev...):
        # kvikio then reads with POSIX into a pinned bounce buffer and copies up itself.
        self.compat_mode = bool(kvikio.defaults.is_compat_mode_preferred())
        self._posix: PosixBackend | None = None  # set once a kvikio read has failed

    def read_into_device(self, path: Path, offset: int, length: int, dst: DeviceBuffer) -> int:
        if self._posix is None:
            try:
                return self._read(path, offset, length, dst)
            except RuntimeError as e:  # kvikio's errors (cuFile, missing libcuda) are RuntimeErrors
                log.warning("kvikio read failed (%s); reading into GPU memory with POSIX from now on", e)
                self._posix = PosixBackend(self.driver)
        return self._posix.read_into_device(path, offset, length, dst)

    def _read(self, path: Path, offset: int, length: int, dst: DeviceBuffer) -> int:
        start, size = _check_dst(offset, length, dst)
        end = offset + length
        file_size = os.stat(path).st_size
        if end > file_size:
            raise OSError(f"{path}: file ends at {file_size}, expected {end} bytes")
        whole = min(start + size, align_down(file_size)) - start  # whole pages inside the file
        if whole > 0:
            f = self._kvikio.CuFile(str(path), "r")
            try:
                got = f.pread(DeviceBuffer(dst.ptr, whole), whole, start).get()
            finally:
                f.close()
            if got != whole:
                raise OSError(f"{path}: kvikio read {got} of {whole} bytes at {start}")
        tail = start + max(whole, 0)
        if tail < end:  # the file's last partial page: POSIX, never past EOF
            self.driver.htod(dst.ptr + (tail - start), _pread_exact(path, tail, end - tail))
        return offset - start


def choose_backend(wanted: str, driver: Driver | None) -> DiskBackend | None:
    """The backend for reads into GPU memory, or None without a CUDA driver.

    "kvikio" falls back to POSIX, with one log line, when kvikio is not installed or
    cannot start; a machine without a CUDA driver has nothing to read into, and
    `gpu_driver.load()` has already said so in its own single line.
    """
    if wanted not in BACKENDS:
        raise ValueError(f"disk_backend is {wanted!r}; expected one of {', '.join(BACKENDS)}")
    if driver is None:
        return None
    if wanted == "posix":
        return PosixBackend(driver)
    try:
        import kvikio  # noqa: PLC0415 - optional extra, imported only when asked for
        import kvikio.defaults  # noqa: PLC0415

        backend = KvikioBackend(kvikio, driver)
    except Exception as e:  # ImportError, or kvikio failing to load its libraries
        log.warning("disk_backend=kvikio unavailable (%s: %s); reading into GPU memory with POSIX "
                    "(pip install 'kvcraft[gpu]' for kvikio)", type(e).__name__, e)
        return PosixBackend(driver)
    log.info("disk reads into GPU memory through kvikio (%s)",
             "compat mode: no GPUDirect Storage" if backend.compat_mode else "GPUDirect Storage")
    return backend


def backend_for(wanted: str, device: int = 0) -> DiskBackend | None:
    """`choose_backend` with this process's CUDA driver."""
    return choose_backend(wanted, gpu_driver.load(device))
