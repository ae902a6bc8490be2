"""CRAFT chunk reorder (CRAFT §4.2 "Chunk Reordering").

    Chunks_reordered = sort(C, -freq(c))

A *stable* sort by descending CA-Table count: chunks with equal counts keep the
retriever's order, so the result is deterministic and a request of all-new chunks
is left as retrieved. Only a first turn is reordered; a conversation's history is
never reordered (and later turns keep the retriever order, CRAFT §4.3).
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


def reorder_by_count(items: Sequence[T], count: Callable[[T], int] | dict[T, int]) -> list[T]:
    """Stable sort of `items` by descending count (a function, or a map holding every item)."""
    # sorted() is stable; negating the count sorts descending without reverse=True,
    # which would keep ties stable too but reads less obviously.
    if isinstance(count, dict):
        if len(set(count.values())) == 1:
            return list(items)  # all counts equal: the stable sort keeps the order
        return sorted(items, key=lambda it: -count[it])
    return sorted(items, key=lambda it: -count(it))
