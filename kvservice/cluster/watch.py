"""Whether a node's client reaches the Mooncake master, and whether the master still holds
the node's segment: when either comes back, the node puts its variants back.

The master drops a node whose client has not pinged it for its client_ttl, and the objects
in that node's segment with it; the client remounts the segment by itself, empty. That
happens when the node was cut off, but also when it was frozen (a stalled host, a long
pause: from the node's side nothing failed, it only lost time) or when the master was
frozen and expired every client as it resumed. So the node keeps a mark, a one-byte object
pinned in its own segment (`MooncakeClient.mark`), and asks for it every MARK_INTERVAL_S:
a master that answers without it dropped the segment, however that came about.

Every call to a master that does not answer waits: ~4 s for a dead one, the RPC timeout
(30 s) for a frozen one. The check runs in a thread of its own and is waited for at most
the client's timeout; while the master does not answer, `client.up` is False and calls
fail at once. A TCP connection to the master's address, tried every WATCH_INTERVAL_S,
tells a cut link sooner: CONNECT_FAILURES in a row (one alone can be a master just
resumed, its backlog of connections not yet taken).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Protocol

log = logging.getLogger("kvcraft.cluster")

WATCH_INTERVAL_S = 0.25
MARK_INTERVAL_S = 1.0
CONNECT_FAILURES = 2
# What a check finds (`MooncakeClient.check`): the master answers; it does not; it dropped
# this node's segment, which is marked again now; it dropped it, not mounted again yet.
UP, DOWN, DROPPED, REMOUNTING = "up", "down", "dropped", "remounting"


class Watched(Protocol):
    """What the watch needs of a client (`kvservice.cluster.mooncake.MooncakeClient`)."""

    up: bool  # the master answers; set here, and by a call that found it silent
    master_address: str
    on_rejoin: list[Callable[[], None]]  # called here when the node must put its variants back

    def connects(self) -> bool:
        """A TCP connection to the master opens (quick; False on a cut link)."""

    def check(self) -> str:
        """UP, DOWN, DROPPED or REMOUNTING: one call to the master, which may block (a
        frozen master holds it until its RPC timeout)."""

    def settle(self) -> None:
        """Close what the master left open while it did not answer (put sessions)."""


class MasterWatch:
    def __init__(self, client: Watched, timeout_s: float) -> None:
        self.client = client
        self.timeout_s = timeout_s  # a check unanswered this long: the master is down
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._again = False  # check at the next tick, not after MARK_INTERVAL_S
        self._unconnected = 0  # ticks in a row whose connection to the master failed
        self._checks = ThreadPoolExecutor(1, thread_name_prefix="kvcraft-mooncake-check")
        self._thread = threading.Thread(target=self._run, name="kvcraft-mooncake-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pending: Future | None = None
        since = last = 0.0
        while True:
            self._wake.wait(WATCH_INTERVAL_S)  # a tick, or a check that just answered
            self._wake.clear()
            if self._stop.is_set():
                return
            now = time.monotonic()
            if pending is not None and pending.done():
                self._found(pending)
                pending, last = None, now
            if not self.client.connects():
                self._unconnected += 1
                if self._unconnected >= CONNECT_FAILURES:
                    self._down("no connection to it")
                continue
            self._unconnected = 0
            if pending is None and (not self.client.up or self._again or now - last >= MARK_INTERVAL_S):
                self._again = False
                try:
                    pending, since = self._checks.submit(self.client.check), now
                except RuntimeError:  # closed meanwhile
                    return
                pending.add_done_callback(lambda _: self._wake.set())
            elif pending is not None and now - since > self.timeout_s:
                self._down(f"no answer within {self.timeout_s:.1f}s")

    def _found(self, check: Future) -> None:
        try:
            found = check.result()
        except Exception as e:  # a check that fails is a master that does not answer
            found = DOWN
            log.debug("master check failed: %s", e)
        if found == DOWN:
            self._down("its calls fail")
        elif found == REMOUNTING:
            self._again = True  # check again at the next tick; the put-back waits for the segment
            if not self.client.up:
                log.info("the Mooncake master answers again; this node's segment is not mounted yet")
                self.client.up = True
        elif found == DROPPED:
            log.warning("the Mooncake master dropped this node's segment (its client expired, or the master "
                        "restarted): putting this node's variants back")
            self._rejoin()
        elif not self.client.up:
            log.info("the Mooncake master answers again: this node puts back what the cluster lost")
            self._rejoin()

    def _down(self, why: str) -> None:
        if self.client.up:
            log.warning("the Mooncake master at %s does not answer (%s): cluster calls fail at once until it does",
                        self.client.master_address, why)
        self.client.up = False

    def _rejoin(self) -> None:
        self.client.up = True
        try:
            self.client.settle()
        except Exception as e:  # settled before the key is written again in any case
            log.debug("settling open put sessions failed: %s", e)
        for call in self.client.on_rejoin:
            try:
                call()
            except Exception as e:  # the watch goes on: the next rejoin tries again
                log.warning("putting this node's variants back failed to start: %s", e)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * WATCH_INTERVAL_S)
        self._checks.shutdown(wait=False, cancel_futures=True)  # a check stuck on a frozen master
