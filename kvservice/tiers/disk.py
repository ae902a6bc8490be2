"""Disk tier: one file per variant, written so that a crash never leaves a file that
looks complete but is not (docs/storage.md, "Disk format" and "Write order").

Layout: <root>/<vid[:2]>/<vid>.kv holds, for each layer in order, K bytes then V bytes.
A write goes to <vid>.<random>.kv.tmp, is fsynced, renamed into place and the directory fsynced;
only then may the store commit metadata. Leftover .tmp files are crash debris.

This is the POSIX backend, used where CUDA is absent. On CUDA machines kvikio reads
straight into GPU memory; that backend is not built yet (no GPU in this environment).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Iterator

from kvservice.tiers.base import Tier

SUFFIX = ".kv"
TMP_SUFFIX = ".kv.tmp"


class DiskWriter:
    """Streams one variant's payload into a temporary file; `commit` makes it durable."""

    def __init__(self, tier: "DiskTier", variant_id: str) -> None:
        self._tier = tier
        self.variant_id = variant_id
        self.final = tier.path_of(variant_id)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        # A unique temporary name: two streams storing the same variant never collide.
        self.tmp = self.final.with_name(f"{variant_id}.{secrets.token_hex(4)}{TMP_SUFFIX}")
        self._fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.written = 0

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self.written += len(data)

    def commit(self) -> None:
        """fsync the file, rename it into place, fsync the directory."""
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1
        os.replace(self.tmp, self.final)
        _fsync_dir(self.final.parent)
        self._tier._add_usage(self.written)

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.tmp.unlink(missing_ok=True)


class DiskTier(Tier):
    name = "disk"

    def __init__(self, root: Path, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._used = 0

    def path_of(self, variant_id: str) -> Path:
        return self.root / variant_id[:2] / (variant_id + SUFFIX)

    def writer(self, variant_id: str) -> DiskWriter:
        return DiskWriter(self, variant_id)

    def read(self, variant_id: str, offset: int, length: int) -> memoryview:
        try:
            fd = os.open(self.path_of(variant_id), os.O_RDONLY)
        except FileNotFoundError:
            raise KeyError(variant_id) from None
        try:
            buf = bytearray(length)
            view = memoryview(buf)
            got = 0
            while got < length:
                n = os.preadv(fd, [view[got:]], offset + got)
                if n == 0:
                    raise OSError(f"{variant_id}: payload file ends at {offset + got}, expected {offset + length}")
                got += n
            return view
        finally:
            os.close(fd)

    def size_of(self, variant_id: str) -> int | None:
        try:
            return self.path_of(variant_id).stat().st_size
        except FileNotFoundError:
            return None

    def delete(self, variant_id: str) -> None:
        size = self.size_of(variant_id)
        self.path_of(variant_id).unlink(missing_ok=True)
        if size is not None:
            self._add_usage(-size)

    def usage(self) -> int:
        return self._used

    def __contains__(self, variant_id: str) -> bool:
        return self.path_of(variant_id).exists()

    def _add_usage(self, n: int) -> None:
        self._used += n

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
                    yield f.name[: -len(SUFFIX)], f.stat().st_size

    def reset_usage(self, used: int) -> None:
        self._used = used


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
