"""Storage tiers, fastest first, behind one protocol (`kvservice.tiers.base.Tier`)."""

from __future__ import annotations

from kvservice.config import Config
from kvservice.tiers.base import PayloadShape, SharedLocation, Tier, TierFull, TierWriter
from kvservice.tiers.disk import DiskTier
from kvservice.tiers.host import HostTier, segment_name

__all__ = ["PayloadShape", "SharedLocation", "Tier", "TierFull", "TierWriter", "build_tiers"]


def build_tiers(cfg: Config) -> list[Tier]:
    """The tiers this machine runs, fastest first: the host slab, then the disk (home)."""
    root = cfg.data_path
    root.mkdir(parents=True, exist_ok=True)
    return [
        HostTier(cfg.host_budget_bytes, segment_name(root)),
        DiskTier(root / "payloads", cfg.disk_budget_bytes),
    ]
