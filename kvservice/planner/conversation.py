"""Conversation-scoped chunk deduplication (CRAFT §4.3).

    ChunkMap : conv_id -> {chunk_id}

At each turn, a chunk already sent in an earlier turn of the same conversation is
dropped from the current turn: its information is already in the conversation's
context. We keep each chunk key with its position in the conversation's send
order (key -> 0, 1, 2, ...), because the variant choice needs the chunks before a chunk in the
prompt, history included (Cache-Craft eq. 6-7).

Entries expire `ttl_s` seconds after their conversation's last turn. An expired or
unknown conversation has no history, so nothing is dropped: forgetting can only
cause a redundant chunk, never a missing one. For the same reason a conversation
keeps only its last `max_chunks` keys: the history (and every Plan response, which
carries it and each chunk's prefix) stays bounded however long the conversation
runs. An id longer than MAX_ID_CHARS is held as its digest: what a conversation holds is
bounded whatever id a client sends (a request may carry megabytes of one). The clock is
injectable so tests never sleep.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from typing import Callable, Container, Iterable, Sequence

DEFAULT_TTL_S = 3600.0
DEFAULT_MAX_CONVERSATIONS = 100_000
DEFAULT_MAX_CHUNKS = 512
MAX_ID_CHARS = 64  # a longer conversation id is held as its 128-bit blake2b digest (`_held`)


def dedup(keys: Sequence[str], sent: "Container[str]") -> tuple[list[str], list[str]]:
    """Split `keys` into (kept, dropped): a key is dropped iff it was sent before —
    in `sent` (earlier turns) or earlier in `keys` itself. Order is preserved."""
    kept: list[str] = []
    dropped: list[str] = []
    seen: set[str] = set()
    for k in keys:
        if k in sent or k in seen:
            dropped.append(k)
        else:
            kept.append(k)
            seen.add(k)
    return kept, dropped


class ChunkMap:
    """conv_id -> chunk keys already sent, with a TTL, a bound on conversations (the
    least recently active one is forgotten first) and a bound on each conversation's
    keys (the earliest sent are forgotten first)."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic,
                 max_conversations: int = DEFAULT_MAX_CONVERSATIONS,
                 max_chunks: int = DEFAULT_MAX_CHUNKS) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1, got {max_chunks}")
        self.ttl_s = ttl_s
        self.max_conversations = max_conversations
        self.max_chunks = max_chunks
        self._clock = clock
        # conv_id (`_held`) -> (last turn time, sent key -> send position); least recent first.
        self._convs: OrderedDict[str | bytes, tuple[float, dict[str, int]]] = OrderedDict()

    def history(self, conv_id: str) -> dict[str, int] | None:
        """Keys sent in earlier turns -> their send position (0, 1, ...), in send
        order; None if the conversation is unknown or expired. Do not mutate."""
        if not conv_id:
            return None
        self._expire()
        entry = self._convs.get(_held(conv_id))
        return None if entry is None else entry[1]

    def record(self, conv_id: str, keys: Iterable[str]) -> None:
        """Remember that this turn sent `keys`; refreshes the conversation's TTL."""
        if not conv_id:
            return
        conv_id = _held(conv_id)
        now = self._clock()
        entry = self._convs.pop(conv_id, None)
        sent: dict[str, int] = {} if entry is None else entry[1]
        for k in keys:
            if k not in sent:
                sent[k] = len(sent)
        if len(sent) > self.max_chunks:
            # Keep the latest keys, renumbered from 0: positions are send order.
            kept = list(sent)[-self.max_chunks:]
            sent = {k: i for i, k in enumerate(kept)}
        self._convs[conv_id] = (now, sent)
        while len(self._convs) > self.max_conversations:
            self._convs.popitem(last=False)

    def forget(self, conv_id: str) -> None:
        self._convs.pop(_held(conv_id), None)

    def __len__(self) -> int:
        self._expire()
        return len(self._convs)

    def _expire(self) -> None:
        deadline = self._clock() - self.ttl_s
        convs = self._convs
        while convs:
            first = next(iter(convs.values()))
            if first[0] > deadline:
                break
            convs.popitem(last=False)


def _held(conv_id: str) -> str | bytes:
    """The key a conversation is held under: its id, or the digest of a long one (bytes, so
    that no id a client sends is another's digest)."""
    if len(conv_id) <= MAX_ID_CHARS:
        return conv_id
    return hashlib.blake2b(conv_id.encode(errors="surrogatepass"), digest_size=16).digest()
