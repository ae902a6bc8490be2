"""Command-line arguments the benchmarks share: counts refused below their least value by
argparse itself (a usage line and exit 2), never by a stack trace from deep in a run."""

from __future__ import annotations

import argparse
from typing import Callable


def count(least: int = 1) -> Callable[[str], int]:
    """An argparse `type`: a whole number >= `least` (1: a count of things to run; 0: an
    index, a seed, a share of warm-up)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {least}, got {text!r}") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {n}")
        return n

    return parse


__all__ = ["count"]
