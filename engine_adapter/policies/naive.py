"""`naive`: every cached chunk served as stored, nothing recomputed but the fresh chunks and the
question (the base policy's answers, unchanged): the floor every selection is measured against."""

from __future__ import annotations

from dataclasses import dataclass

from engine_adapter.policies.base import ReusePolicy


@dataclass(frozen=True)
class Naive(ReusePolicy):
    name = "naive"


__all__ = ["Naive"]
