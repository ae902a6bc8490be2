"""Storage tiers, fastest first, behind one protocol (`kvservice.tiers.base.Tier`)."""

from __future__ import annotations

import logging

from kvservice.config import Config
from kvservice.tiers import gpu_driver
from kvservice.tiers.disk_backend import choose_backend
from kvservice.tiers.base import PayloadShape, SharedLocation, Tier, TierFull, TierWriter
from kvservice.tiers.disk import DiskTier
from kvservice.segments import remove_stale_segments, segment_name
from kvservice.tiers.host import HostTier

log = logging.getLogger("kvcraft.tiers")

__all__ = ["PayloadShape", "SharedLocation", "Tier", "TierFull", "TierWriter", "build_tiers"]


def build_tiers(cfg: Config, instance_id: str, driver: gpu_driver.Driver | None = None) -> list[Tier]:
    """The tiers this machine runs, fastest first: the gpu pool (when `gpu_budget_bytes`
    is set and a CUDA driver loads), the host slab (pinned where CUDA exists), the disk
    (home), then the remote tier when a Mooncake Store cluster is configured
    (`remote_master`, docs/scale-out.md). `instance_id`: this run of the service (names
    its shared memory). `driver`: this process's CUDA driver by default (tests pass a
    fake). Call only while holding the data dir: it removes earlier instances' segments."""
    root = cfg.data_path
    root.mkdir(parents=True, exist_ok=True)
    if driver is None:
        driver = gpu_driver.load(cfg.gpu_device)  # None without CUDA: said once, in one log line
    for name in remove_stale_segments(root):
        log.info("removed shared memory %s left by an earlier run on %s", name, root)
    out: list[Tier] = [HostTier(cfg.host_budget_bytes, segment_name(root, instance_id), driver)]
    try:  # a tier that fails to start: the ones made before it let go of what they hold
        out.append(DiskTier(root / "payloads", cfg.disk_budget_bytes))
        if cfg.gpu_budget_bytes:
            if driver is None:
                log.warning("gpu_budget_bytes is set but no CUDA driver loads: running without the gpu tier")
            else:
                from kvservice.tiers.gpu import GpuTier

                out.insert(0, GpuTier(cfg.gpu_budget_bytes, driver, choose_backend(cfg.disk_backend, driver)))
        if cfg.remote_master:
            from kvservice.tiers.remote import remote_tier  # imports Mooncake: only when configured

            out.append(remote_tier(cfg))
    except BaseException:
        for t in out:
            t.close()
        raise
    return out
