"""Names of the host slab's shared-memory segments (/dev/shm/<name>), one per service
instance on a data directory, and the removal of those an earlier instance left. Its own
module: the service's tiers name segments with it, and `kvservice.launcher` cleans up after
a child service it killed, without importing the tiers."""

from __future__ import annotations

import hashlib
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def segment_prefix(data_dir: Path) -> str:
    return "kvcraft-" + hashlib.sha1(str(Path(data_dir).resolve()).encode()).hexdigest()[:16]


def segment_name(data_dir: Path, instance_id: str) -> str:
    """The host slab's segment of one service instance on `data_dir`."""
    return f"{segment_prefix(data_dir)}-{instance_id}"


def remove_stale_segments(data_dir: Path) -> list[str]:
    """Unlink the segments earlier instances on `data_dir` left (a crash skips the
    unlink); their names. Call only while holding the data dir (its metadata lock) or once
    the one service on it has exited."""
    prefix = segment_prefix(data_dir)
    removed = []
    for path in SHM_DIR.glob(prefix + "*"):
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            pass
    return removed
