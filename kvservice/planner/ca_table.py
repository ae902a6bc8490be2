"""Chunk-Access Table (CRAFT §4.1 "Chunk-Access Table", §4.2 "Table Update").

Access counts of chunk keys over a sliding window of the last W requests
(CRAFT §6.2.4: W = 1000 balances stable counts against stale ones). A request
counts a chunk once, however often the chunk appears in it. When a request
leaves the window its chunks lose one count, and a chunk whose count falls to 0
is removed, so the table holds only chunks of the last W requests.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

DEFAULT_WINDOW = 1000


class CATable:
    """Sliding-window access counts; O(k) per observed request of k chunks."""

    __slots__ = ("window", "_requests", "_counts")

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._requests: deque[tuple[str, ...]] = deque()
        self._counts: dict[str, int] = {}

    def observe(self, keys: Iterable[str], distinct: bool = False) -> None:
        """Record one request's retrieved chunk keys (CRAFT: "increment the access
        count of each retrieved chunk by one"), evicting the oldest request if the
        window is full. distinct: the caller knows `keys` holds no key twice."""
        distinct = tuple(keys) if distinct else tuple(dict.fromkeys(keys))
        counts = self._counts
        for k in distinct:
            counts[k] = counts.get(k, 0) + 1
        self._requests.append(distinct)
        if len(self._requests) > self.window:
            for k in self._requests.popleft():
                c = counts[k] - 1
                if c:
                    counts[k] = c
                else:
                    del counts[k]

    def counts_of(self, keys: Iterable[str]) -> dict[str, int]:
        """key -> count for each of `keys` (one lookup each, for sorting)."""
        get = self._counts.get
        return {k: get(k, 0) for k in keys}

    def count(self, key: str) -> int:
        """Number of requests in the window that retrieved `key`."""
        return self._counts.get(key, 0)

    def __len__(self) -> int:
        """Number of distinct chunks in the window (the table's size)."""
        return len(self._counts)
